"""Rewards: the built-in rule rewards (:mod:`.builtin`), calling reward functions by keyword as TRL does and combining
them, outcome and per step (:mod:`.calling`), learned reward models as reward functions (:mod:`.learned`), and the
``code_tests`` reward (:mod:`.code`). The rule rewards parse text and never evaluate it; ``code_tests`` runs the
completions' programs, in :mod:`grpokit.sandbox` only. Names in a config (``accuracy``, ``model:DIR``, ...) are
:mod:`grpokit.resolve`'s."""
