"""Llama-family decoders (Llama, Qwen2, Mistral without a sliding window) run by our own forward.

The same weights and the same math as the Hugging Face forward, without what costs time at GRPO's
shapes (docs/benchmarks.md, "grpokit vs TRL: speed"):

- decoding prefills each prompt once for its G completions, writes keys and values into a cache that
  doubles its room when full (a few copies per rollout, not one per token by concatenation), fuses
  the q/k/v and gate/up projections into one product each with the norms' weights folded in, runs
  them on the CPU with weights packed once for oneDNN (much faster than MKL at a few rows), and drops
  finished completions from the batch;
- the reference and policy passes run every projection on real tokens only (prompts' left padding and
  what follows each completion's EOS are never computed) and a group's shared prompt once, with
  attention on per-row layouts where padding only trails, so plain causal attention is exact; the LM
  head runs only where a completion token is predicted.

Modules are called as modules where they are not plain ``nn.Linear`` (a LoRA adapter, a quantised
layer) or carry forward hooks, so wrapped and hooked models keep their behaviour. :func:`unsupported`
says why a model cannot take this path; callers then use the model's own forward (``fast_path: false``
forces that everywhere).

:class:`LlamaFamily` is the two passes together: :mod:`~grpokit.models.fast.hidden_states` (training and
reference) and :mod:`~grpokit.models.fast.decode` (sampling, the growing cache), on the modules and shared
pieces of :mod:`~grpokit.models.fast.parts`; :mod:`~grpokit.models.fast.support` holds :func:`unsupported`.
"""

from __future__ import annotations

from grpokit.models.fast.decode import Decoding
from grpokit.models.fast.hidden_states import HiddenStates
from grpokit.models.fast.support import SUPPORTED, unsupported, unwrap_peft

__all__ = ["SUPPORTED", "LlamaFamily", "unsupported", "unwrap_peft"]


class LlamaFamily(HiddenStates, Decoding):
    """A supported model's modules, run by the two passes GRPO needs: :meth:`decode`, and
    :meth:`hidden_states` followed by the LM head."""
