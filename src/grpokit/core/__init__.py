"""The math, as pure functions on tensors and text: the GRPO objective (:mod:`.objective`), PPO's GAE and value
loss (:mod:`.ppo_objective`), the optimizer and its schedule (:mod:`.optim`), reading answers (:mod:`.answers`) and
mapping character offsets to tokens (:mod:`.offsets`). Nothing here knows a model, a config or a trainer; every
function is readable beside its equation in docs/math.md. The lowest layer: it imports nothing of grpokit."""
