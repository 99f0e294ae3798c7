"""``grpokit bootstrap`` from a GRPO config (:func:`bootstrap_from_config`): its rows (a dataset's, or an
environment's), its rewards (or the environment's rubric), and its tools and environments, sampled as a run with the
config samples; SFT between iterations. The bootstrap itself is :mod:`grpokit.algorithms.bootstrap`'s."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from grpokit.algorithms.bootstrap import BootstrapSettings, bootstrap
from grpokit.algorithms.sft import SFTTrainer
from grpokit.config import ConfigError, GRPOConfig, SFTConfig, load_config, reward_funcs_of
from grpokit.data import check_columns
from grpokit.from_config import announce_sandboxes, sampling_engine
from grpokit.resolve import (
    code_options,
    dataset_options,
    environment_task,
    load_rows,
    resolve_reward_functions,
    task_options,
    with_environment,
)
from grpokit.rollout.engines import Engine
from grpokit.rollout.tools import ToolBox, add_environment_reward, resolve_tools, reward_keywords
from grpokit.runtime.device import resolve_device


def bootstrap_from_config(config: GRPOConfig, output: str | Path, settings: BootstrapSettings, *, iterations: int = 1,
                          num_prompts: int | None = None, few_shot: str | None = None,
                          sft_config: str | None = None) -> dict[str, Any]:
    """``grpokit bootstrap``: :func:`bootstrap` on the first ``num_prompts`` rows of ``config.dataset`` (or of the
    config's ``environment``), judged by its ``reward_funcs`` (or the environment's rubric, and an environment's own
    reward) and sampled as a run with ``config`` samples, its tools and environments included, the demonstrations
    read from the ``few_shot`` file. Between iterations, SFT (the ``sft_config`` file's settings) from
    ``config.model`` on every row kept so far (as STaR: never from the last round's model), into ``OUTPUT.sft-N``.
    Returns the summary."""
    if iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {iterations}")
    environment = environment_task(config)
    given, _, reward_funcs, weights, factory = with_environment(config, environment, None, None, None, None)
    rows = (given if given is not None else load_rows(config.dataset, config.seed, dataset_options(config),
                                                      reasoning_gym_options=config.reasoning_gym))[:num_prompts]
    source = config.environment or config.dataset
    check_columns(rows, [config.prompt_column], source=source)
    if few_shot is not None:
        demonstrations = load_rows(few_shot)
        check_columns(demonstrations, ["prompt", "completion"], source=f"--few_shot {few_shot}")
        settings = dataclasses.replace(settings, few_shot=demonstrations)
    sft_file = {}
    if sft_config:  # checked before any sampling, not after the first iteration's
        sft_file = yaml.safe_load(Path(sft_config).read_text()) or {}
        load_config(sft_config, {"model": config.model}, SFTConfig)  # its errors name the file and key
    functions, weights = resolve_reward_functions(reward_funcs or reward_funcs_of(config), weights,
                                                  code_options(config), task_options(config),
                                                  device=resolve_device(config.device))
    output = Path(output)

    def make_engine(model: str) -> tuple[Engine, Any, ToolBox]:
        return sampling_engine(dataclasses.replace(config, model=model), environment_factory=factory)

    factory = factory or resolve_tools(config)[1]  # the environment's, or the config's environment_factory
    add_environment_reward(functions, weights, factory)
    announce_sandboxes(functions, config.progress_bar)

    def train(kept: Path, iteration: int) -> str:
        out_dir = output.with_name(f"{output.stem}.sft-{iteration}")
        if (out_dir / "model" / "config.json").is_file():  # trained before a crash
            return str(out_dir / "model")
        resume = "latest" if any((out_dir / "checkpoints").glob("step-*")) else None
        # The folder is this bootstrap's own: one left by a crash before its first checkpoint is started over.
        sft = SFTConfig.from_dict({**sft_file, "model": config.model, "dataset": str(kept), "dataset_columns": None,
                                   "output_dir": str(out_dir), "overwrite_output_dir": resume is None,
                                   "system_prompt": config.system_prompt, "chat_template": config.chat_template,
                                   "seed": config.seed, "progress_bar": config.progress_bar, "resume": resume})
        SFTTrainer(sft).train()
        return str(out_dir / "model")

    sampling = dict(prompt_column=config.prompt_column, answer_column=config.answer_column,
                    max_new_tokens=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
                    system_prompt=config.system_prompt, chat_template=config.chat_template, seed=config.seed)
    return bootstrap(rows, functions, weights, output, settings, make_engine=make_engine, model=config.model,
                     iterations=iterations, train=train, sampling=sampling, progress=config.progress_bar,
                     keywords=reward_keywords(factory), source=source)


