"""verifiers 0.4 environments (its v1 API: a taskset, the harness that plays it, ``Trace.rewards``) as grpokit
agents. verifiers 0.4 environments call the model themselves, through an OpenAI-compatible endpoint; here that
endpoint is the episode's URL at grpokit's policy server, which records the tokens sampled (docs/serving.md).

``verifiers_v1_task(name, args)`` loads the environment as verifiers' own ``vf eval`` / env server would, from its
``[env]`` config block: ``name`` is the taskset id (an installed taskset package), ``args`` the rest of the block
(``{"taskset": {...taskset fields}, "agent": {"harness": {"id": "null"}, "max_turns": 4, ...}}``). Its rows are the
taskset's tasks, as the data verifiers' env server rebuilds a task from; its ``agent`` runs one row's episode with
verifiers' own ``Env.run_slot`` (harness, interception, the task's scoring) and returns the trace's named rewards.

Two defaults differ from verifiers' command line, which evaluates in the cloud: a seat with no runtime given runs in
verifiers' ``subprocess`` runtime (here, not in a Prime sandbox), and a seat with no harness given, on a taskset that
bundles none, plays the ``null`` harness (a chat loop) rather than ``bash`` (a coding agent whose commands would run
on this machine). ``agent: {harness: {id: bash}, runtime: {...}}`` in ``args`` picks them back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

from grpokit.agents import verifiers_v1_bridge as bridge
from grpokit.runtime.versions import verifiers_major_minor

__all__ = ["VerifiersV1Error", "VerifiersV1EpisodeError", "VerifiersV1Task", "verifiers_v1_task"]

INSTALL = ("pip install 'grpokit[verifiers_v1]' (verifiers>=0.4,<0.5; or bash scripts/test_verifiers_v1.sh, which "
           "builds .venv-verifiers-v1 with it)")
INFINITE_ROWS = 1024  # rows taken from a taskset that never ends, unless max_rows says otherwise
# grpokit's own keys in args (environment_args), by keyword of verifiers_v1_task; the rest is verifiers' [env] block
GRPOKIT_KEYS = {"eval_taskset": "eval_args", "reward_keys": "reward_keys", "max_rows": "max_rows",
                "on_error": "on_error"}


class VerifiersV1Error(ValueError):
    """verifiers 0.4, or one of its environments, cannot serve the run; the message names what and the fix."""


class VerifiersV1EpisodeError(RuntimeError):
    """An episode that verifiers ran, but whose rewards cannot be given (it failed, or has several policy traces)."""


def _verifiers_v1() -> Any:
    """``verifiers.v1``, checked to be verifiers 0.4's."""
    found = verifiers_major_minor()
    if found is None:
        raise VerifiersV1Error(f"verifiers is not installed: {INSTALL}")
    if found != (0, 4):
        raise VerifiersV1Error(f"verifiers {found[0]}.{found[1]} is installed; grpokit.agents.verifiers_v1 speaks "
                               "verifiers 0.4's v1 API (tasksets, harnesses, Trace.rewards): pip install "
                               "'verifiers>=0.4,<0.5'. verifiers 0.3's environments (load_environment) run through "
                               "grpokit.tasks.verifiers instead")
    import verifiers.v1 as vf

    return vf


def _env_config(vf: Any, name: str, args: dict[str, Any]) -> Any:
    """verifiers' ``[env]`` block for taskset ``name``, with grpokit's two local defaults (module docstring)."""
    from verifiers.v1.configs.agent import AgentConfig, agent_config_fields
    from verifiers.v1.runtimes import SubprocessConfig
    from verifiers.v1.utils.loaders import default_harness_id, harness_config_type

    data = copy.deepcopy(args)
    taskset = dict(data.get("taskset") or {})
    if taskset.setdefault("id", name) != name:
        raise VerifiersV1Error(f"verifiers:{name}: args name another taskset ({taskset['id']!r}); leave "
                               "taskset.id out, the environment's name gives it")
    data["taskset"] = taskset
    try:
        config = vf.resolve_env_config(data)
    except ModuleNotFoundError as e:  # the taskset's package (or one it imports) is not installed
        cause = f" ({e.__cause__})" if e.__cause__ else ""
        raise VerifiersV1Error(f"verifiers environment {name!r} is not installed: {e}{cause}. Install its package "
                               f"(prime env install OWNER/{name}, or pip install it)") from e
    except (TypeError, AttributeError) as e:  # a module that exports no Taskset (e.g. verifiers 0.3's environment)
        raise VerifiersV1Error(f"verifiers environment {name!r} is not a verifiers 0.4 taskset: {e} (a verifiers "
                               "0.3 environment, with load_environment(), needs verifiers 0.3: "
                               "grpokit.tasks.verifiers)") from e
    except ValueError as e:  # pydantic's errors: a field the config does not have, a value of the wrong type
        raise VerifiersV1Error(f"verifiers:{name}: its config (args) does not validate: {e}") from e
    default_runtime = AgentConfig.model_fields["runtime"].default
    bundled = default_harness_id(name) != "bash"
    updates = {}
    for role, spec in agent_config_fields(config).items():
        given = data.get(role) or {}
        change: dict[str, Any] = {}
        if "runtime" not in given and spec.runtime == default_runtime:
            change["runtime"] = SubprocessConfig()
        if "harness" not in given and spec.harness is None and not bundled:
            change["harness"] = harness_config_type("null").model_validate({"id": "null"})
        if change:
            updates[role] = spec.model_copy(update=change)
    return config.model_copy(update=updates) if updates else config


def _rows(taskset: Any, max_rows: int | None, split: str) -> list[dict[str, Any]]:
    """The tasks as rows: the data a task is rebuilt from (defaults left out), as verifiers' env server gets it."""
    if max_rows is not None:
        taskset = taskset.take(max_rows)
    elif not taskset.bounded:
        taskset = taskset.take(INFINITE_ROWS)
    return [{"task": t.data.model_dump(mode="json", exclude_defaults=True), "split": split} for t in taskset]


class VerifiersV1Task:
    """A verifiers 0.4 environment as an agent (see the module docstring). ``rows`` / ``eval_rows``: one per task,
    ``{"task": <its TaskData as JSON>, "split": "train"|"eval"}``; ``agent(client, model, **row)`` runs its episode
    and returns ``{reward name: score}``, ``sum(w * rewards[n] for n, w in zip(reward_names, reward_weights))``
    being verifiers' ``Trace.reward``. ``sampling`` goes with every model call of an episode (verifiers' ``Sampling``:
    ``temperature``, ``top_p``, ``max_tokens`` per call, other keys as given). ``on_episode(episode, rewards)``, if
    set, sees each episode verifiers returned (its traces, metrics, timing) with the rewards given for it."""

    def __init__(self, config: Any, eval_config: Any | None, sampling: Any, reward_keys: dict[str, list[str]],
                 max_rows: int | None, on_error: Literal["raise", "zero"]) -> None:
        from verifiers.v1.utils.loaders import load_environment, load_taskset

        self.name: str = config.taskset.id
        self.env_config = config
        self.sampling: dict[str, Any] = sampling.model_dump(exclude_none=True)
        self._sampling = sampling
        self.on_error = on_error
        self.on_episode: Callable[[Any, dict[str, float]], None] | None = None
        env = load_environment(config)
        self._task_cls = type(env.taskset).task_type()
        self._data_cls = self._task_cls.data_type()
        self._task_configs = {"train": config.taskset.task}
        self.rows: list[dict[str, Any]] = _rows(env.taskset, max_rows, "train")
        self.eval_rows: list[dict[str, Any]] | None = None
        if eval_config is not None:
            self._task_configs["eval"] = eval_config.task
            self.eval_rows = _rows(load_taskset(eval_config), max_rows, "eval")
        if not self.rows:
            raise VerifiersV1Error(f"verifiers environment {self.name!r} has no tasks")
        self.reward_names, self.reward_weights = self._reward_signature(self.rows[0], reward_keys)
        self._local_python = False
        self._serving = bridge.Serving(lambda: load_environment(config))

    def _task(self, task: dict[str, Any], split: str) -> Any:
        """verifiers' task for a row, built as its env server builds one from wire data."""
        if split not in self._task_configs:
            raise VerifiersV1Error(f"verifiers environment {self.name!r}: a row of split {split!r}, which it has not "
                                   "(eval rows need eval_args)")
        return self._task_cls(self._data_cls.model_validate(task), self._task_configs[split])

    def _reward_signature(self, row: dict[str, Any], keys: dict[str, list[str]]) -> tuple[list[str], list[float]]:
        """The names and weights verifiers records rewards under: each ``@vf.reward`` function's (or its keys', for
        one returning keyed scores: ``reward_keys``) and each judge's, at their weights."""
        task = self._task(row["task"], row["split"])
        signature = [(key, float(getattr(fn, "_vf_weight", 1.0)))
                     for fn in task.hooks("reward") for key in keys.get(fn.__name__, [fn.__name__])]
        signature += [(judge.reward_name, float(judge.config.weight)) for judge in task.plugged_judges()]
        names = [name for name, _ in signature]
        if len(set(names)) != len(names):
            raise VerifiersV1Error(f"verifiers environment {self.name!r}: reward names repeat: {names}")
        return names, [weight for _, weight in signature]

    def rewards(self, episode: Any) -> dict[str, float]:
        """The episode's named rewards: its one policy trace's ``Trace.rewards`` scores (a reward verifiers left
        unscored, ``None``, counts 0 as in its ``Trace.reward``)."""
        traces = [trace for trace in episode.traces if trace.agent.trainable]
        errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
        if errors or not episode.ok:
            if self.on_error == "zero":  # verifiers' own Trace.reward of a failed trace: scoring did not run, 0
                return dict.fromkeys(self.reward_names, 0.0)
            shown = "; ".join(f"{e.type}: {e.message}" for e in errors) or "not ok, no error recorded"
            raise VerifiersV1EpisodeError(f"verifiers environment {self.name!r}: the episode failed: {shown}")
        if len(traces) != 1:
            raise VerifiersV1EpisodeError(f"verifiers environment {self.name!r}: the episode has {len(traces)} "
                                          "trainable traces; grpokit trains one reward per episode")
        [trace] = traces
        weights = dict(zip(self.reward_names, self.reward_weights))
        unknown = sorted(set(trace.rewards) - set(weights))
        if unknown:
            raise VerifiersV1Error(f"verifiers environment {self.name!r} recorded rewards {unknown}, which are not "
                                   f"among its reward names {self.reward_names}: a reward function returning keyed "
                                   "scores names them in reward_keys={function name: [keys]}")
        for name, reward in trace.rewards.items():
            if reward is not None and reward.weight != weights[name]:
                raise VerifiersV1Error(f"verifiers environment {self.name!r}: reward {name!r} weighs {reward.weight}, "
                                       f"not {weights[name]} as its function says")
        return {name: float(r.score) if (r := trace.rewards.get(name)) is not None else 0.0
                for name in self.reward_names}

    async def run_episode(self, client: Any, model: str, *, task: dict[str, Any], split: str = "train") -> Any:
        """verifiers' episode (``vf.Episode``) of one row, its model calls through ``client`` (an
        ``openai.AsyncOpenAI``) to ``model``."""
        from verifiers.v1.clients import ModelContext

        vf_task = self._task(task, split)
        bridge.install_client()
        if not self._local_python:
            self._local_python = bridge.use_local_python()
        config, key = bridge.client_config(client)
        context = ModelContext(model=model, client=config, sampling=self._sampling)
        try:
            async with self._serving.env() as env:
                (slot,) = env.slots(vf_task)
                return await env.run_slot(slot, context)
        finally:
            bridge.release(key)

    async def agent(self, client: Any, model: str, *, task: dict[str, Any], split: str = "train",
                    **columns: Any) -> dict[str, float]:
        """Runs the row's episode (other columns are ignored) and returns its named rewards."""
        episode = await self.run_episode(client, model, task=task, split=split)
        rewards = self.rewards(episode)
        if self.on_episode is not None:
            self.on_episode(episode, rewards)
        return rewards


def environment_agent(task: VerifiersV1Task) -> Callable:
    """``task``'s agent as a run takes it: named ``verifiers:NAME`` (errors and metrics say so), its rewards' default
    weights verifiers' own (``reward_weights``, read by :class:`~grpokit.agents.sampler.AgentSampler` where the
    config gives none)."""

    async def agent(client: Any, model: str, *, task: dict[str, Any], split: str = "train",
                    **columns: Any) -> dict[str, float]:
        return await environment.agent(client, model, task=task, split=split)

    environment = task
    agent.__name__ = agent.__qualname__ = f"verifiers:{task.name}"
    agent.reward_weights = list(task.reward_weights)
    return agent


def verifiers_v1_task(name: str, args: dict[str, Any] | None = None, *, eval_args: dict[str, Any] | None = None,
                      sampling: dict[str, Any] | None = None, reward_keys: dict[str, list[str]] | None = None,
                      max_rows: int | None = None, on_error: Literal["raise", "zero"] = "raise") -> VerifiersV1Task:
    """The verifiers 0.4 environment ``name`` (a taskset id) as an agent; ``args``: the rest of its ``[env]`` block.

    ``eval_args``: taskset fields for its eval rows (verifiers has no eval split of its own: e.g. ``{"split":
    "test"}``), merged over ``args["taskset"]``; none, no eval rows. ``sampling``: sent with every model call
    (``temperature``, ``top_p``, ``max_tokens``: grpokit's ``temperature``, ``top_p``, ``max_completion_length``, the
    last per model call; the seat's ``max_output_tokens`` in ``args`` bounds a whole episode).
    ``reward_keys``: the keys of a reward function that returns keyed scores. ``max_rows``: at most this many rows
    per split (a taskset that never ends gives 1024 unless told). ``on_error``: an episode that failed raises
    ``VerifiersV1EpisodeError``, or (``"zero"``) scores 0 on every reward, as verifiers' own total does.

    So that a config file's ``environment_args`` can say them, ``args`` may hold these four too (not verifiers'
    keys: taken out before verifiers reads the block), ``eval_args`` as ``eval_taskset``."""
    vf = _verifiers_v1()
    args = dict(args or {})
    given = {"eval_args": eval_args, "reward_keys": reward_keys, "max_rows": max_rows,
             "on_error": None if on_error == "raise" else on_error}
    for key, keyword in GRPOKIT_KEYS.items():
        if key in args:
            if given[keyword] is not None:
                raise VerifiersV1Error(f"verifiers:{name}: {keyword} is given twice (as {keyword}= and as args' "
                                       f"{key!r})")
            given[keyword] = args.pop(key)
    eval_args, reward_keys, max_rows = given["eval_args"], given["reward_keys"], given["max_rows"]
    on_error = given["on_error"] or "raise"
    if on_error not in ("raise", "zero"):
        raise VerifiersV1Error(f"on_error must be 'raise' or 'zero', not {on_error!r}")
    config = _env_config(vf, name, args)
    eval_config = None
    if eval_args is not None:
        from verifiers.v1.utils.loaders import taskset_config_type

        merged = {**config.taskset.model_dump(exclude_unset=True), **eval_args, "id": name}
        try:
            eval_config = taskset_config_type(name).model_validate(merged)
        except ValueError as e:
            raise VerifiersV1Error(f"verifiers:{name}: eval_args do not validate: {e}") from e
    try:
        sampling_config = vf.SamplingConfig.model_validate(sampling or {})
    except ValueError as e:
        raise VerifiersV1Error(f"verifiers:{name}: sampling does not validate: {e}") from e
    return VerifiersV1Task(config, eval_config, sampling_config, dict(reward_keys or {}), max_rows, on_error)
