"""The training algorithms, each a trainer on the engine (:mod:`grpokit.training.engine`): GRPO and the PPO baseline
(:mod:`.grpo`, with PPO's value model in :mod:`.ppo`), the supervised cold start (:mod:`.sft`), reward-model training
(:mod:`.reward`), iterative RL (:mod:`.iterative`), a cold start bootstrapped from the model (:mod:`.bootstrap`) and the
demo's run (:mod:`.demo`)."""
