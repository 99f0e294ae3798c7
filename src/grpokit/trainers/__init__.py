"""The trainers, each a recipe on the engine (:mod:`grpokit.training.engine`): GRPO and the PPO baseline
(:mod:`.grpo`, with PPO's value model in :mod:`.ppo`), the supervised cold start (:mod:`.sft`), reward-model training
(:mod:`.reward`), iterative RL (:mod:`.iterative`), the sampled rows of ``grpokit sample`` (:mod:`.sample`), the cold
start of ``grpokit bootstrap`` (:mod:`.bootstrap`) and the demo's run (:mod:`.demo`)."""
