"""Rewards: the built-in rule rewards (:mod:`.builtin`), calling reward functions by keyword as TRL does and combining
them, outcome and per step (:mod:`.calling`), and learned reward models as reward functions (:mod:`.learned`).
Rewards parse text; nothing here evaluates it. Names in a config (``accuracy``, ``model:DIR``, ...) are
:mod:`grpokit.resolve`'s."""
