"""The training engine: the run loop every trainer uses (:mod:`.engine`, and :mod:`.supervised` for SFT and
reward-model training), sampling and scoring a step's batch (:mod:`.sampling`), the update's loops (:mod:`.update`),
evaluation on held-out rows (:mod:`.evaluation`), completions sampled and labelled by rewards (:mod:`.labelling`),
checkpoints (:mod:`.checkpoint`), the run directory and trackers (:mod:`.runlog`), data parallelism
(:mod:`.distributed`), and what reads a finished run directory back: its learning curves (:mod:`.plots`) and its HTML
report (:mod:`.report`)."""
