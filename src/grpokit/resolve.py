"""Names a config or the command line may give instead of a path, resolved in this one place.

    model         builtin:arithmetic, builtin:tools   the built-in tasks' warm-started tiny models (built once, cached)
                  gguf:FILE                           a llama.cpp file, converted once and cached (grpokit[gguf])
                  anything else                       a local Hugging Face directory
    dataset       builtin:arithmetic, builtin:tools   the built-in tasks' training rows, in an order set by the seed
                  gsm8k:SOURCE                        GSM8K-style rows (``question``; ``answer`` ending ``#### 72``)
                                                      from any of the sources below
                  reasoning_gym:TASK[,TASK...]        a reasoning-gym task's generated rows (or a mix), seeded
                  hf:ID, or NAME / OWNER/NAME         a Hugging Face Hub dataset (datasets.load_dataset), where no
                    that is no local path             local path has that name and it has no data file's extension
                  anything else                       JSONL, CSV, Parquet, a ``save_to_disk`` directory or a dataset
                                                      folder (datasets.load_dataset)
    reward_funcs  accuracy, math_accuracy, format     the built-in rule rewards (grpokit.rewards.builtin)
                  lenient_accuracy                    the same, reading prose's last number without an <answer>
                  code_tests                          programs run against the row's tests (grpokit.rewards.code)
                  reasoning_gym                       the row's reasoning-gym task's own scorer, in the sandbox
                  arithmetic_steps                    the built-in task's per-step reward (process supervision)
                  arithmetic_substeps                 the same, each column's operands and result two steps
                  model:DIR, or a directory           a learned outcome reward model
                  process_model:DIR                   a learned process reward model
                  FILE.py:NAME, package.module:NAME   a function of your own

Below this module nothing knows these names: models load directories, data loads files, rewards call callables;
the built-in tasks (:mod:`grpokit.tasks`) are reached from here alone.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpokit.config import ConfigError, check_reward_weights
from grpokit.data import DatasetOptions, gsm8k_rows, load_dataset_rows, load_file, rename_columns
from grpokit.models.gguf import GGUF_PREFIX, ConversionError, converted_gguf
from grpokit.models.loading import load_pretrained
from grpokit.rewards.builtin import accuracy_reward, format_reward, lenient_accuracy_reward, math_accuracy_reward
from grpokit.rewards.calling import RewardFunction, reward_name, score_completions
from grpokit.rewards.code import code_tests, make_code_tests
from grpokit.rewards.learned import MODEL_PREFIX, PROCESS_MODEL_PREFIX, OutcomeRewardModel, ProcessRewardModel
from grpokit.rollout.python_tool import sandbox_limits
from grpokit.runtime.device import resolve_device
from grpokit.runtime.progress import quiet_unless
from grpokit.runtime.versions import verifiers_major_minor
from grpokit.tasks import arithmetic, reasoning_gym, tool_task
from grpokit.tasks.environments import EnvironmentTask, load_environment_task
from grpokit.tasks.warm_start import warm_started_model_path
from grpokit.user_code import load_callable

__all__ = ["BUILTIN", "BUILTIN_TOOLS", "builtin_rewards", "code_options", "dataset_options", "eval_judge", "is_hub_id",
           "load_eval_rows", "load_model_and_tokenizer", "load_rows", "model_directory", "resolve_reward_functions",
           "reward_function", "task_options"]

BUILTIN = "builtin:arithmetic"  # the built-in task's dataset and model (grpokit.tasks.arithmetic)
BUILTIN_TOOLS = "builtin:tools"  # the built-in tools task's (grpokit.tasks.tool_task)
GSM8K_PREFIX = "gsm8k:"  # `dataset: gsm8k:PATH`
HUB_PREFIX = "hf:"  # `dataset: hf:ID`: the Hugging Face Hub, whatever the local files are called
# What a Hub id looks like (`name` or `owner/name`), and the extensions that make a name a file's instead.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".gz", ".zip", ".yaml", ".yml")


# ---- models ---------------------------------------------------------------------------------------


def model_directory(name: str | None, seed: int = 0, progress: bool = True) -> str:
    """The Hugging Face directory that ``model`` names: itself, the cached conversion of ``gguf:FILE``, or a
    built-in task's warm-started model (built and cached on first use)."""
    if name is None:
        raise ConfigError("model is required: a Hugging Face model id or directory, 'gguf:FILE', or "
                          "'builtin:arithmetic' (the tiny demo model); on the command line --model, in Python the "
                          "config's model or the trainer's model= (with tokenizer=)")
    if name in (BUILTIN, BUILTIN_TOOLS):
        return str(warm_started_model_path(seed=seed, progress=progress, task=name.removeprefix("builtin:")))
    if name.startswith(GGUF_PREFIX):
        try:
            return str(converted_gguf(name[len(GGUF_PREFIX):]))
        except ConversionError as error:
            raise ConversionError(f"model: {error}") from None
    return checked_model_path(name)


def checked_model_path(name: str) -> str:
    """``model`` as from_pretrained takes it (``~`` expanded), refused naming the key where it is a file, or a
    local-looking path that does not exist (``./x``, ``/x``, ``x/y/z``: nothing a Hub id ``name`` or ``owner/name``
    looks like), before transformers reads it as a Hub repo id and answers "Repo id must be in the form ..."."""
    path = Path(name).expanduser()
    if path.is_file():
        gguf = f"; a llama.cpp GGUF file is 'gguf:{name}'" if name.lower().endswith(".gguf") else ""
        raise ConfigError(f"model: {name!r} is a file; give the directory save_pretrained wrote (config.json, the "
                          f"weights and the tokenizer's files) or a Hugging Face Hub id 'owner/name'{gguf}")
    if not path.exists() and not HUB_ID.fullmatch(name):  # a Hub id is from_pretrained's to look up
        raise ConfigError(f"model: {name!r} does not exist (relative to {Path.cwd()}); give a model directory that "
                          "does, or a Hugging Face Hub id 'owner/name'")
    return str(path) if path.exists() else name


def load_model_and_tokenizer(name: str | None, seed: int = 0, progress: bool = True, dtype: str = "auto"):
    """The causal LM and tokenizer that ``model`` names (:func:`model_directory`); ``dtype``: ``"auto"`` (as
    saved) or one of :data:`grpokit.models.loading.DTYPES`, applied while loading."""
    with quiet_unless(progress):
        return load_pretrained(model_directory(name, seed, progress), dtype)


# ---- datasets -------------------------------------------------------------------------------------


def dataset_options(config: Any, held_out: bool = False) -> DatasetOptions:
    """How a config (GRPOConfig, SFTConfig, RewardConfig) reads its ``dataset``, or with ``held_out`` its
    ``eval_dataset`` (and ``grpokit eval``'s dataset): ``dataset_config``, the train or test split and
    ``dataset_columns``."""
    key = "dataset_test_split" if held_out else "dataset_train_split"
    return DatasetOptions(config.dataset_config, getattr(config, key), config.dataset_columns, key)


def is_hub_id(source: str) -> bool:
    """Whether ``dataset`` names a Hugging Face Hub dataset: ``hf:ID``, or a ``name`` / ``owner/name`` that no local
    path has and with no data file's extension (``missing.jsonl`` stays a file that does not exist)."""
    if source.startswith(HUB_PREFIX):
        return True
    return (HUB_ID.fullmatch(source) is not None and not source.lower().endswith(DATA_SUFFIXES)
            and not Path(source).exists())


def load_rows(source: str | Path | None, seed: int = 0, options: DatasetOptions | None = None, *,
              reasoning_gym_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows that ``dataset`` names: a built-in task's training rows (in an order set by ``seed``), a reasoning-gym
    task's (generated with ``reasoning_gym_options``, the config's ``reasoning_gym`` key, from its seed or ``seed``),
    or ``gsm8k:SOURCE``'s, a Hub id's (:func:`is_hub_id`) or a file's or directory's (:func:`grpokit.data.load_file`),
    read and their columns renamed as ``options`` say (:func:`dataset_options`)."""
    if source is None:
        raise ConfigError("dataset is required: a JSONL, CSV or Parquet file, a dataset folder, a Hugging Face Hub "
                          "dataset id, 'reasoning_gym:TASK' or 'builtin:arithmetic' (the demo's rows); on the command "
                          "line --dataset, in Python the config's dataset or the trainer's train_dataset=")
    source = str(source)
    if source == BUILTIN:
        return arithmetic.train_rows(4096, seed)
    if source == BUILTIN_TOOLS:
        return tool_task.train_rows(4096, seed)
    if source.startswith(reasoning_gym.PREFIX):
        return reasoning_gym.train_rows(source, reasoning_gym_options, seed)
    options = options or DatasetOptions()
    if source.startswith(GSM8K_PREFIX):
        inner = source.removeprefix(GSM8K_PREFIX)
        return gsm8k_rows(_source_rows(inner, options), source)
    return _source_rows(source, options)


def _source_rows(source: str, options: DatasetOptions) -> list[dict[str, Any]]:
    if is_hub_id(source):
        hub_id = source.removeprefix(HUB_PREFIX)
        # `hf:` forces the Hub even where a local folder has the same name (datasets' own prefix for that)
        rows = load_dataset_rows(f"hf://datasets/{hub_id}" if Path(hub_id).exists() else hub_id, options)
    else:
        rows = load_file(source, options)
    return rename_columns(rows, options.columns, source)


def load_eval_rows(source: str | Path, options: DatasetOptions | None = None, *, seed: int = 0,
                   reasoning_gym_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The held-out rows that ``eval_dataset`` (or ``grpokit eval``'s dataset) names: a built-in task's held-out set
    (problems its training rows never hold), a reasoning-gym task's (past the training rows' seeds, without their
    questions), else the rows of :func:`load_rows` (``options``: its test split)."""
    if str(source) == BUILTIN:
        return arithmetic.held_out_rows()
    if str(source) == BUILTIN_TOOLS:
        return tool_task.held_out_rows()
    if str(source).startswith(reasoning_gym.PREFIX):
        return reasoning_gym.held_out_rows(str(source), reasoning_gym_options, seed)
    return load_rows(source, options=options)


# ---- reward functions -----------------------------------------------------------------------------


def eval_judge(config: Any, rows: list[dict[str, Any]], environment: EnvironmentTask | None = None
               ) -> RewardFunction | None:
    """What judges held-out completions (:func:`grpokit.training.evaluation.evaluate`'s ``judge``): ``eval_reward``
    when the config names one (with an ``environment``, one of its rubric's functions by name, or ``rubric``: the
    rubric's weighted total); else an environment's rubric, programming problems (a ``tests`` column) by the share of
    their tests passed, a reasoning-gym dataset by its task's scorer; None (``accuracy``, with its lenient reading)
    for other rows."""
    if environment is not None:
        by_name = {reward_name(fn): fn for fn in environment.reward_funcs}
        if config.eval_reward is None or config.eval_reward == "rubric":
            return rubric_judge(environment)
        if config.eval_reward in by_name:
            return by_name[config.eval_reward]
    if config.eval_reward is not None:
        return reward_function(config.eval_reward, {**code_options(config), "binary": False}, task_options(config),
                               key="eval_reward", device=resolve_device(config.device))
    if rows and "tests" in rows[0]:
        return make_code_tests(**{**code_options(config), "binary": False})
    return reasoning_gym.TaskScore(**task_options(config)) if _reasoning_gym_source(config) else None


def rubric_judge(environment: EnvironmentTask) -> RewardFunction:
    """One function scoring a completion by an environment's rubric: the weighted total of its functions."""

    def rubric(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        options = {key: columns.pop(key) for key in ("completion_ids", "trainer_state", "messages") if key in columns}
        total, _ = score_completions(environment.reward_funcs, environment.reward_weights, prompts, completions,
                                     columns, **options)
        return total.tolist()

    rubric.__name__ = "rubric"
    return rubric


def _reasoning_gym_source(config: Any) -> str | None:
    """The config's reasoning-gym dataset (``dataset``, else ``eval_dataset``), if it names one."""
    return next((str(s) for s in (config.dataset, config.eval_dataset) if str(s).startswith(reasoning_gym.PREFIX)),
                None)


def task_options(config: Any) -> dict[str, Any]:
    """The ``reasoning_gym`` reward's settings in a run's config, as :class:`~grpokit.tasks.reasoning_gym.TaskScore`
    takes them: ``answer_extraction``, the tasks' settings of a reasoning-gym dataset, the sandbox's."""
    source = _reasoning_gym_source(config)
    configs = reasoning_gym.task_configs(source, (config.reasoning_gym or {}).get("config")) if source else {}
    return {"extraction": config.answer_extraction, "configs": configs, "isolation": config.sandbox,
            "seconds": config.sandbox_timeout}


def code_options(config: Any) -> dict[str, Any]:
    """The ``code_tests`` reward's settings in a run's config (``sandbox``, ``sandbox_timeout``, ``code_tests_mode``),
    as :func:`~grpokit.rewards.code.make_code_tests` takes them."""
    return {"binary": config.code_tests_mode == "binary", "isolation": config.sandbox,
            "limits": sandbox_limits(config.sandbox_timeout)}


def builtin_rewards() -> dict[str, RewardFunction]:
    """Reward functions available by name in a config (``code_tests`` with its default settings: a run's own are
    :func:`code_options`)."""
    return {"accuracy": accuracy_reward, "math_accuracy": math_accuracy_reward, "format": format_reward,
            "lenient_accuracy": lenient_accuracy_reward, "code_tests": code_tests,
            "reasoning_gym": reasoning_gym.TaskScore(),
            "arithmetic_steps": arithmetic.arithmetic_steps_reward,
            "arithmetic_substeps": arithmetic.arithmetic_substeps_reward}


def reward_function(spec: str, code: dict[str, Any] | None = None, task: dict[str, Any] | None = None, *,
                    key: str = "reward_funcs", **model_options: Any) -> RewardFunction:
    """One ``reward_funcs`` entry that is not a callable → the function: a built-in name, a reward model
    (``model:PATH`` or a directory → :class:`~grpokit.rewards.learned.OutcomeRewardModel`, ``process_model:PATH`` →
    :class:`~grpokit.rewards.learned.ProcessRewardModel`, loaded with ``model_options``: ``device``,
    ``mixed_precision``, ``batch_size``, ...), or ``FILE.py:NAME`` / ``package.module:NAME``; ``code``: the
    ``code_tests`` reward's settings (:func:`code_options`), ``task`` the ``reasoning_gym`` reward's
    (:func:`task_options`). Errors name the config ``key`` that gave ``spec`` (``reward_funcs``, ``eval_reward``), and
    for an unknown name the closest built-in one."""
    if spec == "code_tests" and code:
        return make_code_tests(**code)
    if spec == "reasoning_gym" and task:
        return reasoning_gym.TaskScore(**task)
    builtin = builtin_rewards()
    if spec in builtin:
        return builtin[spec]
    if spec.startswith(PROCESS_MODEL_PREFIX):
        return ProcessRewardModel(spec[len(PROCESS_MODEL_PREFIX):], **model_options)
    if spec.startswith(MODEL_PREFIX):
        return OutcomeRewardModel(spec[len(MODEL_PREFIX):], **model_options)
    if Path(spec).is_dir():
        return OutcomeRewardModel(spec, **model_options)
    if ":" in spec:
        return load_callable(spec, key)
    close = difflib.get_close_matches(spec, sorted(builtin), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"{key}: unknown reward {spec!r}; {hint}built-in rewards are {sorted(builtin)}; a function "
        "of your own is 'path/to/file.py:name' or 'package.module:name' (or a callable in Python); a reward "
        "model is 'model:DIR' or 'process_model:DIR'"
    )


def resolve_reward_functions(
    specs: Sequence[str | RewardFunction], weights: Sequence[float] | None = None,
    code: dict[str, Any] | None = None, task: dict[str, Any] | None = None, **model_options: Any
) -> tuple[list[RewardFunction], list[float]]:
    """The reward functions (callables as they are, names through :func:`reward_function`) and their weights
    (None: 1.0 each), checked: names unique, one weight per function."""
    functions = [spec if callable(spec) else reward_function(spec, code, task, **model_options) for spec in specs]
    names = [reward_name(fn) for fn in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"reward_funcs: names must be unique, got {names}")
    check_reward_weights(weights, len(functions))
    return functions, [1.0] * len(functions) if weights is None else list(weights)


def runs_as_agent(config: Any) -> bool:
    """Whether the config's ``environment`` calls the model itself (verifiers 0.4's): it then runs as an agent."""
    environment = getattr(config, "environment", None) or ""
    return environment.startswith("verifiers:") and verifiers_major_minor() == (0, 4)


def agent_environment(config: Any) -> Any:
    """The config's ``environment`` where it is one that calls the model itself, run as an agent: ``verifiers:NAME``
    with verifiers 0.4 installed (its v1 API: :func:`grpokit.agents.verifiers_v1.verifiers_v1_task`, sampling at the
    run's temperature, top_p and max_completion_length per model call); else None."""
    if not runs_as_agent(config):
        return None
    from grpokit.agents.verifiers_v1 import verifiers_v1_task

    name = config.environment.removeprefix("verifiers:")
    return verifiers_v1_task(name, config.environment_args, sampling={
        "temperature": config.temperature, "top_p": config.top_p, "max_tokens": config.max_completion_length})


def environment_task(config: Any) -> EnvironmentTask | None:
    """The config's ``environment`` (``verifiers:NAME``, ``openenv:TARGET``) loaded with ``environment_args``: its
    rows, rubric and per-completion environments (None without one, or for an environment that runs as an agent:
    :func:`agent_environment`)."""
    if getattr(config, "environment", None) is None or runs_as_agent(config):
        return None
    task = load_environment_task(config.environment, config.environment_args, seed=config.seed)
    if task.prompt_column != config.prompt_column:
        raise ValueError(f"environment {config.environment!r}: its rows hold the prompt in {task.prompt_column!r}; "
                         f"set prompt_column: {task.prompt_column} (it is {config.prompt_column!r})")
    return task


def with_environment(config: Any, task: EnvironmentTask | None, train_dataset: Any, eval_dataset: Any,
                     reward_funcs: Sequence[Any] | None, environment_factory: Any) -> tuple[Any, ...]:
    """What a run takes from its environment where nothing else was given: ``(train_dataset, eval_dataset,
    reward_funcs, reward_weights, environment_factory)`` — the environment's rows (and held-out rows, unless the
    config chooses its own), its rubric and weights (unless ``reward_funcs`` are given; ``reward_weights`` in the
    config replace its weights), its environment factory."""
    weights = config.reward_weights
    if task is None:
        return train_dataset, eval_dataset, reward_funcs, weights, environment_factory
    own_held_out = config.eval_dataset is not None or config.eval_fraction
    if reward_funcs is None and config.reward_funcs is None:
        reward_funcs, weights = task.reward_funcs, weights or task.reward_weights
    return (task.rows if train_dataset is None else train_dataset,
            task.eval_rows if eval_dataset is None and not own_held_out else eval_dataset,
            reward_funcs, weights, environment_factory or task.environment_factory)
