"""Iterative RL (DeepSeekMath §4.1.4; docs/reward_models.md, "Iterative RL"): the reward model learns from
the policy's own samples between stretches of RL, and the reference model follows the policy.

With ``rl_iterations: K`` the run's ``max_steps`` fall into K iterations of ``iteration_steps`` steps. After
each but the last (the step that ends iteration k, k = 1 .. K-1):

1. ``reward_model_prompts`` training prompts (a seeded draw) get G = ``num_generations`` completions each from
   the current policy, labelled by the rule rewards ``reward_model_labels``
   (:func:`grpokit.training.labelling.sample_rows`,
   what ``grpokit sample`` writes: a label, a process reward's steps, or pairs, in the reward model's form),
   calling the run's tools as its training rollouts do;
2. the one learned reward model in ``reward_funcs`` is retrained, from its current weights, on those rows plus
   a random ``reward_model_replay`` share of its older rows (``reward_model_config``'s dataset, and every
   earlier iteration's samples) with ``reward_model_config``'s settings
   (:class:`~grpokit.algorithms.reward.RewardTrainer`), and scores with the new weights from the next step on;
3. the reference model is reset to the current policy, so that the next step's KL is exactly 0.

What iteration k writes lives in ``output_dir/reward_model/iteration-k/``: ``samples.jsonl``, the reward
trainer's run (``metrics.jsonl``, ``model/``), and one line per iteration in ``iterations.jsonl`` beside them.
The policy's optimizer and learning-rate schedule run on across iterations (one schedule over
``max_steps``). A checkpoint holds the reward model's and the reference's weights, so a run resumes
bit-exactly; the older rows are read back from the earlier iterations' ``samples.jsonl``. Under torchrun the
first process samples and retrains; the new weights are then broadcast to every process.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from grpokit.algorithms.reward import RewardTrainer, detect_form
from grpokit.config import ConfigError, GRPOConfig, RewardConfig, load_config
from grpokit.data import DataError
from grpokit.resolve import code_options, dataset_options, load_rows, resolve_reward_functions
from grpokit.rewards.calling import RewardFunction
from grpokit.rewards.learned import OutcomeRewardModel, ProcessRewardModel
from grpokit.runtime.seeding import preserved_rng
from grpokit.training.distributed import World, broadcast_from_main
from grpokit.training.labelling import sample_rows

__all__ = ["IterativeRL"]

# The column names grpokit sample writes; older rows are renamed to them (from reward_model_config's names).
COLUMNS = {"prompt_column": "prompt", "completion_column": "completion", "label_column": "label",
           "chosen_column": "chosen", "rejected_column": "rejected", "steps_column": "steps"}


class IterativeRL:
    """The iteration boundaries of a run and the work done at each (:meth:`advance`). Built, and every
    setting checked, before the policy loads."""

    def __init__(self, config: GRPOConfig, reward_funcs: Sequence[RewardFunction], world: World):
        learned = [fn for fn in reward_funcs if isinstance(fn, (OutcomeRewardModel, ProcessRewardModel))]
        if len(learned) != 1:
            raise ConfigError(f"rl_iterations > 1 retrains the learned reward model in reward_funcs, so it needs "
                              f"exactly one ('model:DIR' or 'process_model:DIR'); found {len(learned)}")
        self.config, self.world, self.reward_model = config, world, learned[0]
        self.process = isinstance(self.reward_model, ProcessRewardModel)
        self.labels, self.label_weights = resolve_reward_functions(config.reward_model_labels,
                                                                   config.reward_model_label_weights,
                                                                   code_options(config))
        if any(isinstance(fn, (OutcomeRewardModel, ProcessRewardModel)) for fn in self.labels):
            raise ConfigError("reward_model_labels: the labels must come from rule rewards; a learned reward model "
                              "would be trained on its own scores")
        where = config.reward_model_config or "reward_model_config"
        self.reward_config = load_config(config.reward_model_config, {"model": str(self.reward_model.path)},
                                         RewardConfig)
        rc = self.reward_config
        self.first_rows = [self._renamed(row) for row in load_rows(rc.dataset, rc.seed, dataset_options(rc))] \
            if rc.dataset else []
        self.eval_rows = [self._renamed(row) for row in load_rows(rc.eval_dataset, rc.seed,
                                                                  dataset_options(rc, held_out=True))] \
            if rc.eval_dataset else None
        if rc.form != "auto":
            self.form = rc.form
        elif self.first_rows:
            self.form = detect_form(self.first_rows, replace(rc, **COLUMNS), rc.dataset)
        else:
            self.form = "steps" if self.process else "labelled"
        if (self.form == "steps") != self.process:
            kind = "a process" if self.process else "an outcome"
            raise ConfigError(f"{where}: its rows are of the form {self.form!r}, but the reward model in reward_funcs "
                              f"is {kind} model; process models train on 'steps' rows, outcome models on "
                              "'labelled' rows or 'pairs'")
        self.steps = config.iteration_steps
        self.root = Path(config.output_dir) / "reward_model"

    def iteration(self, step: int) -> int:
        """The iteration (1 .. K) that step ``step`` (1-based) belongs to."""
        return (step - 1) // self.steps + 1

    def ends_iteration(self, step: int) -> bool:
        """Step ``step`` ends an iteration after which the reward model is retrained (every one but the last)."""
        return step % self.steps == 0 and step < self.config.max_steps

    # ---- the work at an iteration's end -------------------------------------------------------------

    def advance(self, trainer: Any) -> dict[str, Any]:
        """Sample, retrain the reward model, reset the reference (the module docstring's steps 1-3), after
        step ``trainer.step`` (of the :class:`~grpokit.algorithms.grpo.GRPOTrainer` that holds this object); returns
        what was done (also a line of ``iterations.jsonl``)."""
        k = trainer.step // self.steps
        folder = self.root / f"iteration-{k}"
        summary = None
        with preserved_rng():
            if self.world.main:
                started = time.perf_counter()
                new = self._sample(trainer, k)
                if folder.exists():  # left by an attempt interrupted before its checkpoint: start it afresh
                    shutil.rmtree(folder)
                folder.mkdir(parents=True)
                with (folder / "samples.jsonl").open("w", encoding="utf-8") as out:
                    out.writelines(json.dumps(row) + "\n" for row in new)
                summary = {"iteration": k, "step": trainer.step, **self._retrain(trainer, new, k, folder),
                           "seconds": time.perf_counter() - started}
                with (self.root / "iterations.jsonl").open("a", encoding="utf-8") as log:
                    log.write(json.dumps(summary) + "\n")
        # The other processes wait here for the first one's new weights.
        summary = broadcast_from_main(self.reward_model.model, summary, self.world)
        if trainer.reference is not None:
            trainer.reference.reset(trainer.model)
        if self.world.main and self.config.progress_bar:
            print(f"iteration {k}: reward model retrained on {summary['rows']} rows "
                  f"(eval accuracy {summary.get('eval_accuracy')}); reference reset", flush=True)
        return summary

    def _sample(self, trainer: Any, k: int) -> list[dict[str, Any]]:
        config = self.config
        rows, seed = trainer.sampler.rows, config.seed * 7919 + k
        draw = random.Random(seed).sample(range(len(rows)), min(config.reward_model_prompts, len(rows)))
        trainer.engine.update_weights(trainer.step)  # the policy as this iteration left it
        sampled, _ = sample_rows(
            trainer.engine, trainer.tokenizer, [rows[i] for i in draw], self.labels, self.label_weights,
            num_generations=config.num_generations, prompt_column=config.prompt_column,
            answer_column=config.answer_column, max_new_tokens=config.max_completion_length,
            temperature=config.temperature, top_p=config.top_p, system_prompt=config.system_prompt,
            chat_template=config.chat_template, seed=seed,
            batch_size=config.prompts_per_step, pairs=self.form == "pairs", progress=False,
            toolbox=trainer.sampler.toolbox,
        )
        if self.form == "steps" and not sampled:
            raise DataError("reward_model_labels: no sampled completion got step labels; a process reward model "
                            "retrains on steps, so name a process reward (such as 'arithmetic_steps')")
        return sampled

    def _older_rows(self, k: int) -> list[dict[str, Any]]:
        """The reward model's rows before iteration k's: its first data and iterations 1 .. k-1's samples."""
        rows = list(self.first_rows)
        for j in range(1, k):
            path = self.root / f"iteration-{j}" / "samples.jsonl"
            if not path.is_file():
                raise DataError(f"{path} is missing: iterative RL replays every earlier iteration's samples (was "
                                "output_dir changed or cleaned since the run started?)")
            rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return rows

    def _retrain(self, trainer: Any, new: list[dict[str, Any]], k: int, folder: Path) -> dict[str, Any]:
        older = self._older_rows(k)
        replayed = random.Random(self.reward_config.seed * 7919 + k).sample(
            older, round(self.config.reward_model_replay * len(older)))
        config = replace(self.reward_config, **COLUMNS, form=self.form, dataset=None, eval_dataset=None,
                         output_dir=str(folder),
                         seed=self.reward_config.seed + k, device=str(trainer.device),
                         mixed_precision=trainer.mixed_precision, resume=None,
                         progress_bar=self.config.progress_bar)
        model = self.reward_model.model  # trained in place, from its current weights
        reward_trainer = RewardTrainer(config, model=model.requires_grad_(True), tokenizer=self.reward_model.tokenizer,
                                       train_dataset=new + replayed, eval_dataset=self.eval_rows)
        history = reward_trainer.train()
        model.eval().requires_grad_(False)
        # Its checkpoints cannot be resumed from (a resumed run redoes the whole iteration end): only model/ stays.
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        last = history[-1]
        return {"rows": len(new) + len(replayed), "new_rows": len(new), "replayed_rows": len(replayed),
                "loss": last["loss"], "eval_accuracy": last.get("eval_accuracy"), "reward_steps": len(history)}

    def _renamed(self, row: dict[str, Any]) -> dict[str, Any]:
        """An older row with reward_model_config's column names as grpokit sample writes them."""
        out = dict(row)
        for key, standard in COLUMNS.items():
            name = getattr(self.reward_config, key)
            if name in row:
                out[standard] = row[name]
        return out
