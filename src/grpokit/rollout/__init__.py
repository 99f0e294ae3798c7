"""Rollouts: sampling G completions per prompt with a KV cache (:mod:`.generate`), and the tools a model may call
while it writes — the plain-text protocol, :class:`~.tools.ToolBox` and :class:`~.tools.ToolSession` (:mod:`.tools`),
a chat template's own tool format (:mod:`.tool_templates`) and the built-in tools: the calculator (:mod:`.calculator`)
and ``python`` (:mod:`.python_tool`, programs run in :mod:`grpokit.sandbox`)."""
