"""TRL's front door: ``from grpokit.trl import GRPOConfig, GRPOTrainer`` runs a TRL 1.16 GRPO script on grpokit.

:class:`GRPOConfig` has TRL's keys, defaults and meanings (a key grpokit cannot honour is refused, naming it:
:mod:`grpokit.trl.keys`); :class:`GRPOTrainer` has TRL's signature and surface (``train``, ``save_model``, ``state``,
callbacks). docs/trl.md says what maps to what and what differs.
"""

from grpokit.trl.config import GRPOConfig
from grpokit.trl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
