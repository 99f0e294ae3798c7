"""``GRPOTrainer`` with TRL 1.16's signature, on grpokit's :class:`~grpokit.algorithms.grpo.GRPOTrainer`.

    from grpokit.trl import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward,
                          args=GRPOConfig(output_dir="out", use_cpu=True), train_dataset=dataset)
    trainer.train()
    trainer.save_model()

The run is grpokit's (its sampler, objective, checkpoints, ``metrics.jsonl``); around it this class keeps TRL's
surface: a ``transformers.TrainerState`` (``state``: ``global_step`` in optimizer steps, ``max_steps``, ``epoch``,
``log_history`` with TRL's metric names, averaged over ``logging_steps``), ``transformers.TrainerCallback`` events
(``on_init_end``, ``on_train_begin``, ``on_step_begin``, ``on_step_end``, ``on_log``, ``on_save``, ``on_train_end``;
a callback's ``control.should_training_stop`` / ``should_save`` / ``should_log`` are honoured), ``save_model``,
``push_to_hub``, ``train(resume_from_checkpoint=...)``. Reward functions get that ``TrainerState`` as
``trainer_state``.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import DefaultFlowCallback, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import TrainOutput

from grpokit.algorithms.grpo import GRPOTrainer as GrpokitTrainer
from grpokit.config import ConfigError
from grpokit.data import given_rows
from grpokit.resolve import load_model_and_tokenizer
from grpokit.training.run_dir import OutputDirInUse
from grpokit.trl.config import GRPOConfig
from grpokit.trl.convert import lora_settings, prompt_format, reward_functions, trl_metrics, window_mean
from grpokit.trl.evaluation import evaluate_rewards

__all__ = ["GRPOTrainer"]

STATE_FILE = "trainer_state.json"  # beside each grpokit checkpoint: the TrainerState (log_history) to resume


class GRPOTrainer:
    """TRL 1.16's ``GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` running grpokit underneath
    (``self.grpokit_trainer``: grpokit's trainer; ``self.grpokit_config``: the config it runs)."""

    def __init__(
        self,
        model: str | torch.nn.Module,
        reward_funcs: Any,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory: Callable[[], Any] | None = None,
    ):
        if args is None:  # TRL's default: output_dir named after the model
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise ConfigError(f"args must be a grpokit.trl.GRPOConfig, got {type(args).__name__} (a trl.GRPOConfig's "
                              "keys: pass them to grpokit.trl.GRPOConfig)")
        if optimizers != (None, None):
            raise ConfigError("optimizers: a custom optimizer or scheduler is not supported; grpokit builds AdamW and "
                              "its schedule from args (optim, learning_rate, lr_scheduler_type, warmup_steps)")
        if quantization_config is not None:
            raise ConfigError("quantization_config is not supported: grpokit trains full-precision or bf16 weights "
                              "(LoRA through peft_config); load the model without quantization")
        if rollout_func is not None:
            raise ConfigError("rollout_func is not supported: grpokit samples with its own engine; multi-turn "
                              "rollouts go through tools or environment_factory (docs/environments.md)")
        if reward_processing_classes is not None:
            raise ConfigError("reward_processing_classes is not supported: a reward model given by path loads its own "
                              "tokenizer")
        if train_dataset is None:
            raise ConfigError("train_dataset is required")
        if args.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError(f"eval_strategy={args.eval_strategy.value!r} needs an eval_dataset")
        self.args, self.eval_dataset = args, eval_dataset
        self.train_dataset = train_dataset
        rows = given_rows(train_dataset, "train_dataset")
        keys: dict[str, Any] = {"chat_template": prompt_format(rows), **lora_settings(peft_config)}
        if isinstance(model, str):
            keys["model"] = model
            loaded, tokenizer = load_model_and_tokenizer(model, args.seed, not args.disable_tqdm,
                                                         args.grpokit_settings()["dtype"])
            model, processing_class = loaded, processing_class or tokenizer
        else:
            keys["model"] = getattr(model.config, "_name_or_path", "") or "model"  # what config.yaml records
            if processing_class is None:
                from transformers import AutoTokenizer

                processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        self.grpokit_config = args.to_grpokit(len(rows), **keys)
        processing_class = with_template_kwargs(processing_class, args.chat_template_kwargs)
        self.grpokit_trainer = GrpokitTrainer(self.grpokit_config, model=model, tokenizer=processing_class,
                                      train_dataset=rows, reward_funcs=reward_functions(reward_funcs),
                                      tools=tools, environment_factory=environment_factory)
        self.model, self.processing_class = self.grpokit_trainer.model, processing_class
        self.reward_funcs = self.grpokit_trainer.reward_funcs
        self.updates = args.updates_per_generation  # TRL's optimizer steps per grpokit step
        self.steps_per_epoch = len(rows) // args.prompts_per_generation * self.updates
        self.state = self._run_state(TrainerState())
        self.grpokit_trainer.sampler.trainer_state = lambda step: self.state  # reward functions' trainer_state
        self.control = TrainerControl()
        policy = self.grpokit_trainer.policy
        self.callback_handler = CallbackHandler([DefaultFlowCallback], self.model, processing_class,
                                                policy.optimizer, policy.scheduler)
        for callback in callbacks or []:
            self.add_callback(callback)
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    def _run_state(self, state: TrainerState) -> TrainerState:
        """``state`` with this run's totals and intervals (a resumed state keeps only its progress and history)."""
        state.max_steps = self.grpokit_config.max_steps * self.updates
        state.logging_steps, state.save_steps = int(self.args.logging_steps), int(self.args.save_steps)
        state.eval_steps = int(self.args.eval_steps or self.args.logging_steps)
        state.num_train_epochs = max(1, -(-state.max_steps // max(1, self.steps_per_epoch)))
        state.train_batch_size = self.args.per_device_train_batch_size
        return state

    # ---- callbacks -------------------------------------------------------------------------------

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.remove_callback(callback)

    @property
    def log_history(self) -> list[dict[str, float]]:
        return self.state.log_history

    def is_world_process_zero(self) -> bool:
        return self.grpokit_trainer.world.main

    @property
    def accelerator(self) -> Accelerator:
        """What TRL scripts call on ``trainer.accelerator`` (``print``, ``is_main_process``, ...), from grpokit's
        processes."""
        return Accelerator(self.grpokit_trainer.world, self.grpokit_trainer.device)

    @property
    def hub_model_id(self) -> str:
        return self.args.hub_model_id or Path(self.args.output_dir).name

    # ---- training --------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        """Train to ``args.max_steps`` (or ``num_train_epochs``); ``resume_from_checkpoint``: True (the newest
        checkpoint under ``output_dir/checkpoints``) or a checkpoint's path."""
        if kwargs:
            raise ConfigError(f"train(): {', '.join(kwargs)} not supported (TRL's train takes "
                              "resume_from_checkpoint)")
        inner, args = self.grpokit_trainer, self.args
        which = None
        if resume_from_checkpoint:
            which = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        try:
            path = inner.begin(which)  # output_dir claimed (another run's is refused), resumed, its files started
        except OutputDirInUse as error:  # said with this front's way out
            if not error.held:
                raise
            raise OutputDirInUse(f"output_dir {error.folder} already holds a run ({', '.join(error.held)}); continue "
                                 "it with trainer.train(resume_from_checkpoint=True), or choose another output_dir "
                                 "(or remove that one) to start over") from None
        if which:
            if path is not None and (path / STATE_FILE).is_file():  # (None: 'auto' found no checkpoint)
                self.state = self._run_state(TrainerState.load_from_json(str(path / STATE_FILE)))
            self.state.global_step = inner.step * self.updates
        start, window, losses = time.perf_counter(), [], []
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and not resume_from_checkpoint:
            self.evaluate()
        saved_at = None
        while inner.step < inner.max_steps and not self.control.should_training_stop:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            metrics = trl_metrics(inner.training_step())
            metrics["learning_rate"] = inner.policy.scheduler.get_last_lr()[0]  # as TRL logs it: after the step
            window.append(metrics)
            losses.append(metrics["loss"])
            should_log = should_evaluate = should_save = False
            for _ in range(self.updates):  # TRL's optimizer steps this generation batch made
                self.state.global_step += 1
                epoch, self.state.epoch = self.state.epoch or 0.0, self.state.global_step / max(1, self.steps_per_epoch)
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                if int(self.state.epoch) > int(epoch):  # an epoch ended
                    self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                should_log |= self.control.should_log
                should_evaluate |= self.control.should_evaluate
                should_save |= self.control.should_save
                self.control.should_log = self.control.should_evaluate = self.control.should_save = False
            if should_log:
                self._log(window_mean(window))
                window = []
            if should_evaluate:
                self.evaluate()
            if should_save:
                saved_at = self._save_checkpoint()
        if saved_at is None or inner.step * self.updates != self.state.global_step or \
                not saved_at.name.endswith(f"{inner.step:06d}"):
            saved_at = self._save_checkpoint(final=True)  # always: the run can be resumed
        runtime = time.perf_counter() - start
        summary = {"train_runtime": runtime, "train_steps_per_second": len(losses) * self.updates / runtime,
                   "train_loss": sum(losses) / len(losses) if losses else 0.0, "epoch": self.state.epoch,
                   "step": self.state.global_step}
        self.state.log_history.append(summary)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if inner.run_log is not None:
            inner.run_log.finish()
        if args.push_to_hub:
            self.push_to_hub()
        return TrainOutput(self.state.global_step, summary["train_loss"], summary)

    def end(self) -> None:
        """End the trackers' runs (``train`` ends them too; transformers' ``Trainer.end``)."""
        if self.grpokit_trainer.run_log is not None:
            self.grpokit_trainer.run_log.finish()

    def _log(self, logs: dict[str, float]) -> None:
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs=logs)

    def _save_checkpoint(self, final: bool = False) -> Path:
        path = self.grpokit_trainer.save_checkpoint()
        if self.grpokit_trainer.world.main:
            self.state.save_to_json(str(path / STATE_FILE))
        if not final or self.args.save_strategy != "no":
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return path

    # ---- the model -------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy and tokenizer in ``output_dir`` (``args.output_dir`` by default), as ``save_pretrained`` writes
        them (LoRA: the merged weights, and the adapter alone in ``output_dir/adapter``)."""
        path = Path(output_dir or self.args.output_dir)
        self.grpokit_trainer.save(path, adapter=path / "adapter")

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    **kwargs: Any) -> Any:
        """Save the model to ``output_dir`` and upload it to ``hub_model_id`` (default: ``output_dir``'s name)."""
        from huggingface_hub import create_repo, upload_folder

        self.save_model()
        repo = self.args.hub_model_id or Path(self.args.output_dir).name
        try:
            create_repo(repo, token=self.args.hub_token, private=self.args.hub_private_repo, exist_ok=True)
            return upload_folder(repo_id=repo, folder_path=self.args.output_dir, commit_message=commit_message,
                                 token=self.args.hub_token, ignore_patterns=["checkpoints/*"])
        except Exception as error:  # no network, no token, no rights: say which repo and why
            raise RuntimeError(f"push_to_hub: could not upload {self.args.output_dir} to the Hub repo {repo!r}: "
                               f"{type(error).__name__}: {error}. The model is saved in {self.args.output_dir}."
                               ) from error

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """TRL's evaluation: ``num_generations_eval`` (default ``num_generations``) completions of each prompt of
        ``eval_dataset`` (default: the trainer's), sampled by the policy as it is now and scored by the reward
        functions; the rewards and lengths under TRL's names with ``eval_`` before them, logged and returned. It
        changes nothing the training run draws."""
        rows = self.eval_dataset if eval_dataset is None else eval_dataset
        if rows is None:
            raise ConfigError("evaluate() needs an eval_dataset (give one to GRPOTrainer or to evaluate)")
        if isinstance(rows, dict):  # TRL takes several named eval sets: each reported under its own prefix
            return {k: v for name, part in rows.items()
                    for k, v in self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}").items()}
        args = self.args
        g = args.num_generations_eval or args.num_generations
        metrics = evaluate_rewards(self.grpokit_trainer, rows, g,
                                   max(1, args.per_device_eval_batch_size * args.world_size // g), metric_key_prefix)
        self._log(metrics)
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics=metrics)
        return metrics


def with_template_kwargs(tokenizer: Any, kwargs: dict | None) -> Any:
    """``tokenizer``, or with ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``) passed to every
    ``apply_chat_template`` call (prompts, tool turns, reward models' chats): a copy, the caller's left as it is."""
    if not kwargs:
        return tokenizer
    bound = copy.copy(tokenizer)
    bound.apply_chat_template = functools.partial(type(tokenizer).apply_chat_template, bound, **kwargs)
    return bound


class Accelerator:
    """The part of ``accelerate.Accelerator`` that TRL scripts use on ``trainer.accelerator``."""

    def __init__(self, world: Any, device: torch.device):
        self.is_main_process = self.is_local_main_process = world.main
        self.process_index, self.num_processes, self.device = world.rank, world.size, device

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def end_training(self) -> None:
        """Nothing to end: grpokit's trackers finish with the run."""
