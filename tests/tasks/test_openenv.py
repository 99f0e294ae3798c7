"""OpenEnv environments (``environment: openenv:TARGET``): a number-guessing Environment defined here, run in this
process and behind OpenEnv's own server (a real uvicorn process), played through grpokit's environment protocol,
its rewards scored by grpokit as the environment gives them, and the errors that name what is wrong.

Marked ``openenv`` (deselected by default): bash scripts/test_openenv.sh builds OpenEnv's environment and runs them."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.openenv
try:
    from openenv.core import Action, Environment, GenericEnvClient, Observation, State
except ImportError:
    pytest.skip("OpenEnv is not installed (bash scripts/test_openenv.sh)", allow_module_level=True)

from grpokit import GRPOConfig, GRPOTrainer  # noqa: E402
from grpokit.cli.main import main  # noqa: E402
from grpokit.data import DataError  # noqa: E402
from grpokit.rewards.calling import score_completions, score_steps  # noqa: E402
from grpokit.tasks.environments import load_environment_task  # noqa: E402
from grpokit.tasks.openenv import OpenEnvError  # noqa: E402
from grpokit.tasks.openenv_episode import render, turn_ends  # noqa: E402
from grpokit.tasks.tiny_model import build_model  # noqa: E402
from helpers import TINY, approx_scores  # noqa: E402

HERE = Path(__file__).resolve()
TARGET = f"{HERE}:GuessEnv"


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str = ""
    tries_left: int = 0


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess a number in [low, high] drawn from the reset's seed, in ``tries`` steps: a right guess ends the episode
    with reward 1, a wrong one gives 0.5 - |guess - secret| / (2 (high - low + 1)) and a hint, text that is not a
    number -1. ``fail_on``: a guess whose step raises; ``fail_seed``: a seed whose reset raises; ``slow_on``: a guess
    whose step takes 2 s; ``no_reward``: steps without a reward; ``bad_done``: a done that is not a bool."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, low: int = 1, high: int = 16, tries: int = 4, fail_on: str | None = None,
                 fail_seed: int | None = None, slow_on: str | None = None, no_reward: bool = False,
                 bad_done: bool = False):
        super().__init__()
        self.low, self.high, self.tries, self.fail_on, self.fail_seed = low, high, tries, fail_on, fail_seed
        self.slow_on = slow_on
        self.no_reward, self.bad_done = no_reward, bad_done
        self._state, self.secret = State(), low

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        if seed is not None and seed == self.fail_seed:
            raise ValueError(f"no game for seed {seed}")
        self.secret = random.Random(seed).randint(self.low, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=f"Guess a number from {self.low} to {self.high}.", tries_left=self.tries)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        if action.guess == self.fail_on:
            raise RuntimeError("the guess broke the game")
        if action.guess == self.slow_on:
            time.sleep(2)
        self._state.step_count += 1
        left = self.tries - self._state.step_count
        try:
            guess = int(action.guess.strip())
        except ValueError:
            reward, message, done = -1.0, "That is not a number.", left <= 0
        else:
            done = guess == self.secret or left <= 0
            reward = 1.0 if guess == self.secret else 0.5 - abs(guess - self.secret) / (2 * (self.high - self.low + 1))
            message = "Right!" if guess == self.secret else ("Higher." if guess < self.secret else "Lower.")
        if self.bad_done:
            return GuessObservation.model_construct(message=message, tries_left=left, reward=reward, done="no",
                                                    metadata={})
        return GuessObservation(message=message, tries_left=left, reward=None if self.no_reward else reward,
                                done=done)

    @property
    def state(self) -> State:
        return self._state


def play(episode, seed: int, turns: list[str]) -> list[str | None]:
    """Drive an episode as the rollout does: reset, then each turn to reply while the env answers; the rest, one
    final turn, to end. The texts it gave back."""
    texts = [episode.reset(prompt="", seed=seed)]
    for turn in turns[:-1]:
        texts.append(episode.reply(turn))
    episode.end(turns[-1] if texts[-1] is not None else None)
    return texts


def direct(seed: int, guesses: list[str], **kwargs: Any) -> tuple[list[dict], list[float], list[bool]]:
    """The same game played on GuessEnv itself: each result's fields (as OpenEnv serializes them), rewards, dones."""
    env = GuessEnv(**kwargs)
    first = env.reset(seed=seed)
    observations, rewards, dones = [first.model_dump(exclude={"reward", "done"})], [], []
    for guess in guesses:
        result = env.step(GuessAction(guess=guess))
        observations.append(result.model_dump(exclude={"reward", "done"}))
        rewards.append(result.reward)
        dones.append(result.done)
        if result.done:
            break
    return observations, rewards, dones


GAMES = [(0, ["8", "4", "12", "x"]), (1, ["3"]), (2, ["a", "16", "1", "9"]), (5, ["8", "8", "8", "8", "8"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER = """
import importlib.util, sys, uvicorn
from openenv.core import create_app
spec = importlib.util.spec_from_file_location("guess_env", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
def factory():  # failing as the in-process tests' env_kwargs make it fail
    return module.GuessEnv(fail_on="boom", fail_seed=4, slow_on="slow")
app = create_app(factory, module.GuessAction, module.GuessObservation, max_concurrent_envs=int(sys.argv[3]))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""
# this interpreter's import path, for the processes the tests start (they import grpokit and tests/helpers.py)
PATH = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@contextlib.contextmanager
def serving(folder: Path, sessions: int = 64) -> Iterator[tuple[str, subprocess.Popen]]:
    """OpenEnv's server app for GuessEnv (``sessions`` at once) in a uvicorn process of its own, on a free port:
    its URL and process, killed at the end."""
    port, log = free_port(), folder / "server.txt"
    with open(log, "w") as out:  # a file, not a pipe that nobody reads and that could fill
        process = subprocess.Popen([sys.executable, "-c", SERVER, str(HERE), str(port), str(sessions)], stdout=out,
                                   stderr=subprocess.STDOUT, env=PATH)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if json.load(response).get("status") == "healthy":
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                pytest.fail(f"the OpenEnv server did not start: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, process
    finally:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("server")) as (url, _):
        yield url


@pytest.fixture(params=["in_process", "server"])
def target(request) -> str:
    return TARGET if request.param == "in_process" else request.getfixturevalue("server_url")


def test_episodes_see_and_score_what_the_env_gives(target):
    task = load_environment_task(f"openenv:{target}", {"episodes": 6, "prompt": "Play."}, seed=3)
    assert [row["seed"] for row in task.rows] == [3, 4, 5, 6, 7, 8] and task.rows[0]["prompt"] == "Play."
    assert task.info["action_field"] == "guess" and task.info["openenv"]
    assert [fn.__name__ for fn in task.reward_funcs] == ["openenv_reward"] and task.eval_rows is None
    episodes = []
    for seed, guesses in GAMES:
        episode = task.environment_factory()
        texts = play(episode, seed, guesses)
        observations, rewards, dones = direct(seed, guesses)
        assert episode.observations == observations and episode.rewards == rewards and episode.dones == dones
        assert episode.turns == guesses[:len(rewards)] and episode.ended
        # the text shown: the observation's one text field, until the episode is done
        shown = [observations[i]["message"] if i <= len(dones) and not dones[i - 1] else None
                 for i in range(1, len(guesses))]
        assert texts == [observations[0]["message"], *shown]
        episodes.append(episode)
    completions = [" / ".join(guesses) for _, guesses in GAMES]
    total, per_function = score_completions(task.reward_funcs, task.reward_weights, [""] * 4, completions,
                                            {"environments": episodes})
    expected = [sum(direct(seed, guesses)[1]) for seed, guesses in GAMES]
    assert per_function["openenv_reward"].tolist() == pytest.approx(expected) and total.tolist() == pytest.approx(
        expected)


def test_server_and_in_process_agree_and_server_matches_its_own_client(server_url):
    ws = server_url.replace("http", "ws")  # either scheme names a server
    local, remote = (load_environment_task(f"openenv:{t}", {"episodes": 1}, seed=0) for t in (TARGET, ws))
    client = GenericEnvClient(base_url=server_url).sync()
    try:
        for seed, guesses in GAMES:
            a, b = local.environment_factory(), remote.environment_factory()
            assert play(a, seed, guesses) == play(b, seed, guesses)
            assert (a.observations, a.rewards, a.dones) == (b.observations, b.rewards, b.dones)
            first = client.reset(seed=seed)
            results = [client.step({"guess": guess}) for guess in b.turns]
            assert b.observations == [first.observation] + [r.observation for r in results]
            assert b.rewards == [r.reward for r in results] and b.dones == [r.done for r in results]
    finally:
        client.close()


def test_last_step_reward_and_max_steps():
    task = load_environment_task(f"openenv:{TARGET}", {"episode_reward": "last", "max_steps": 2}, seed=0)
    episode = task.environment_factory()
    texts = play(episode, 0, ["8", "4", "12"])
    assert texts[-1] is None and len(episode.rewards) == 2 and not episode.done  # cut after 2 steps
    assert task.reward_funcs[0]([""], [episode]) == [direct(0, ["8", "4"])[1][-1]]


def test_process_rewards_land_where_each_turn_ends(target):
    task = load_environment_task(f"openenv:{target}", {"process_rewards": True}, seed=0)
    assert [fn.__name__ for fn in task.reward_funcs] == ["openenv_steps"]
    seed, guesses = 2, ["a", "16", "1", "9"]
    episode = task.environment_factory()
    texts = play(episode, seed, guesses)
    # the completion as the rollout writes it: each turn, then the env's message as a user turn between them
    completion = "".join(f"{turn}<|user|>{text}<|assistant|>" for turn, text in zip(guesses, texts[1:] + [""]))
    _, per_function, steps = score_steps(task.reward_funcs, task.reward_weights, [""], [completion],
                                         {"environments": [episode]})
    rewards = direct(seed, guesses)[1]
    ends = [completion.index(f"{turn}<|user|>") + len(turn) for turn in guesses][:len(rewards)]
    assert steps[0] == approx_scores(list(zip(ends, rewards)))
    assert per_function["openenv_steps"][0].item() == pytest.approx(sum(rewards) / len(rewards))


def test_turn_ends_find_turns_in_order_and_stripped():
    assert turn_ends("7 no 7 yes 7", ["7", "7", "7"]) == [1, 6, 12]
    assert turn_ends("a\n[env]\n b", [" a ", "b"]) == [1, 10]
    # the next turn is looked for past the environment's message, which may hold it
    assert turn_ends("5|try 6, not 5|6", ["5", "6"], ["try 6, not 5"]) == [1, 16]
    assert turn_ends("5|try 6, not 5|6", ["5", "6"]) == [1, 7]  # (without the messages, the hint's 6)
    with pytest.warns(UserWarning, match="not in its completion"):
        assert turn_ends("abc", ["zz"]) == [3]


def test_a_single_turn_rollout_steps_the_completion_at_scoring():
    """Today's rollout resets each episode and calls neither reply nor end: the reward steps the completion."""
    task = load_environment_task(f"openenv:{TARGET}", {}, seed=0)
    episodes = [task.environment_factory() for _ in range(3)]
    for seed, episode in enumerate(episodes):
        episode.reset(seed=seed)
    completions = ["9", "3", "x"]  # as a conversational prompt's assistant messages, which the reward reads
    total, _ = score_completions(task.reward_funcs, task.reward_weights, [[{"role": "user", "content": ""}]] * 3,
                                 completions, {"environments": episodes})
    assert total.tolist() == pytest.approx([direct(s, [c])[1][0] for s, c in enumerate(completions)])
    assert all(e.ended and e.turns == [c] for e, c in zip(episodes, completions))


def test_action_pattern_observation_field_and_rendering():
    task = load_environment_task(f"openenv:{TARGET}", {"action_pattern": r"\[(\d+)\]|(\?)",
                                                        "observation_field": "tries_left"}, seed=0)
    episode = task.environment_factory()
    assert episode.reset(seed=0) == "4"  # the field asked for, as JSON where it is not text
    assert episode.reply("I think [8], not [9]") == "3" and episode.reply("no number ?") == "2"
    assert episode.turns == ["I think [8], not [9]", "no number ?"]
    assert episode.rewards == direct(0, ["8", "?"])[1]
    assert render({"message": "m", "other": "o", "metadata": {}}) == "m"  # a text field of TEXT_FIELDS
    assert render({"board": "x.o", "turn": 2}) == "x.o"  # the one text field
    assert render({"board": "x.o", "legal": "a1", "turn": 2}) == 'board: x.o\nlegal: a1\nturn: 2'
    with pytest.raises(OpenEnvError, match="observation_field 'hint' is not a field"):
        render({"message": "m"}, "hint")


def test_rows_chat_prompt_and_eval_rows():
    task = load_environment_task(f"openenv:{TARGET}", {"episodes": 2, "eval_episodes": 2, "prompt": "Guess.",
                                                        "system_prompt": "Be brief."}, seed=10)
    assert [r["seed"] for r in task.rows] == [10, 11] and [r["seed"] for r in task.eval_rows] == [12, 13]
    assert task.rows[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Guess."}]


def test_env_errors_name_the_env_the_episode_and_the_call(target):
    name = "GuessEnv" if target == TARGET else target
    # in-process, the failures are constructor keywords; the server's factory builds its env with the same
    task = load_environment_task(f"openenv:{target}", {"env_kwargs": {"fail_on": "boom", "fail_seed": 4}}
                                 if target == TARGET else {}, seed=0)
    with pytest.raises(OpenEnvError, match=rf"openenv {name}, episode seed 4: reset\(seed=4\) raised "
                                           r"\w+Error: .*no game for seed 4"):
        task.environment_factory().reset(seed=4)
    episode = task.environment_factory()
    episode.reset(seed=1)
    with pytest.raises(OpenEnvError, match=rf"{name}, episode seed 1: step\(guess='boom'\) raised \w+Error: "
                                           ".*the guess broke the game"):
        episode.reply("boom")


def test_step_results_without_a_reward_or_a_bool_done():
    for settings, why in (({"no_reward": True}, "gave no reward .None.; set environment_args missing_reward"),
                          ({"bad_done": True}, "gave done='no' .str.; expected a bool")):
        episode = load_environment_task(f"openenv:{TARGET}", {"env_kwargs": settings}, seed=0).environment_factory()
        episode.reset(seed=0)
        with pytest.raises(OpenEnvError, match=f"GuessEnv, episode seed 0: step 1 {why}"):
            episode.reply("3")
    spared = load_environment_task(f"openenv:{TARGET}", {"env_kwargs": {"no_reward": True}, "missing_reward": 0},
                                   seed=0).environment_factory()
    spared.reset(seed=0)
    spared.end("3")
    assert spared.rewards == [0.0] and spared.ended


def test_a_server_slower_than_the_timeout(server_url):
    episode = load_environment_task(f"openenv:{server_url}", {"timeout": 0.5}, seed=0).environment_factory()
    episode.reset(seed=0)
    with pytest.raises(OpenEnvError, match=rf"{server_url}, episode seed 0: step\(guess='slow'\) raised TimeoutError"):
        episode.reply("slow")


def test_a_server_that_is_down_is_named_with_how_to_start_one():
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DataError, match=f"no OpenEnv server answers at {down} .*uvicorn"):
        load_environment_task(f"openenv:{down}", {}, seed=0)


def test_setup_errors(monkeypatch):
    with pytest.raises(DataError, match="has no attribute 'GuesEnv'; did you mean 'GuessEnv'"):
        load_environment_task(f"openenv:{HERE}:GuesEnv", {}, seed=0)
    with pytest.raises(DataError, match="cannot import module 'no_such_package.envs'"):
        load_environment_task("openenv:no_such_package.envs:Env", {}, seed=0)
    with pytest.raises(DataError, match="not an OpenEnv Environment class"):
        load_environment_task(f"openenv:{HERE}:direct", {}, seed=0)
    with pytest.raises(DataError, match="unknown environment_args key 'episode'; did you mean 'episodes'"):
        load_environment_task(f"openenv:{TARGET}", {"episode": 3}, seed=0)
    with pytest.raises(DataError, match="action_field 'word' is not a field of GuessAction"):
        load_environment_task(f"openenv:{TARGET}", {"action_field": "word"}, seed=0)
    with pytest.raises(DataError, match=r"GuessEnv\(\*\*\{'colour': 1\}\) raised TypeError"):
        load_environment_task(f"openenv:{TARGET}", {"env_kwargs": {"colour": 1}}, seed=0)
    monkeypatch.setitem(sys.modules, "openenv", None)
    with pytest.raises(DataError, match=r"OpenEnv is not installed: pip install 'grpokit\[openenv\]'"):
        load_environment_task(f"openenv:{TARGET}", {}, seed=0)


def test_training_two_steps_on_the_env(tmp_path, tokenizer):
    """GRPOTrainer with the task as it comes (single-turn: today's rollout resets each episode and the reward steps
    the completion): what completions.jsonl records is GuessEnv's own reward of each completion as a guess."""
    task = load_environment_task(f"openenv:{TARGET}", {"episodes": 8, "prompt": "Guess:",
                                                        "env_kwargs": {"low": 7, "high": 7}}, seed=0)
    config = GRPOConfig(output_dir=str(tmp_path / "run"), prompts_per_step=2, num_generations=4,
                        max_completion_length=4, max_steps=2, log_completions=8, progress_bar=False,
                        mixed_precision="no")
    trainer = GRPOTrainer(config, model=build_model(tokenizer, TINY, seed=0), tokenizer=tokenizer,
                          train_dataset=task.rows, reward_funcs=task.reward_funcs,
                          environment_factory=task.environment_factory)
    history = trainer.train()
    assert len(history) == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 16
    for record in records:
        own = direct(0, [record["completion"]], low=7, high=7)[1][0]
        assert record["openenv_reward"] == pytest.approx(own) and record["reward"] == pytest.approx(own)


def test_multi_turn_training_from_the_config_through_a_server(tmp_path, tokenizer, server_url):
    """environment: openenv:URL alone: each episode a session on the server, its reset's observation after the
    prompt, each turn the model ends stepped and the observation inserted as the next message, the return rewarded."""
    config = GRPOConfig(output_dir=str(tmp_path / "run"), environment=f"openenv:{server_url}",
                        environment_args={"episodes": 8, "prompt": "Guess:"}, prompts_per_step=2, num_generations=4,
                        max_completion_length=24, temperature=1.5, max_steps=2, progress_bar=False,
                        mixed_precision="no")
    trainer = GRPOTrainer(config, model=build_model(tokenizer, TINY, seed=0), tokenizer=tokenizer)
    session = trainer.sampler.toolbox.session(trainer.sampler.rows[:1], 2, 8)
    assert session.prompts == ["Guess:\n\nGuess a number from 1 to 16."] * 2
    history = trainer.train()
    assert all("rewards/openenv_reward" in m for m in history)
    assert sum(m.get("env_replies", 0) for m in history) > 0


def test_the_cli_trains_on_a_server_named_alone(tmp_path, tiny_model_dir, server_url):
    """grpokit train --environment openenv:URL: the command line's route to the server run above."""
    assert main(["train", f"--model={tiny_model_dir}", f"--environment=openenv:{server_url}",
                 "--environment_args={episodes: 8, prompt: 'Guess:'}", f"--output_dir={tmp_path / 'run'}",
                 "--prompts_per_step=2", "--num_generations=4", "--max_completion_length=24", "--temperature=1.5",
                 "--max_steps=2", "--progress_bar=false", "--mixed_precision=no"]) == 0
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all("rewards/openenv_reward" in m for m in history)
    assert sum(m.get("env_replies", 0) for m in history) > 0


# ---- a failed run exits: each fault in a real interpreter, as a user's `grpokit train` meets it -------------------


def train(url: str, model: Path, output_dir: Path, stderr: Path, max_steps: int) -> subprocess.Popen:
    """``python -m grpokit train`` on the server at ``url`` (rows seeded from 10: no seed the server's env fails),
    in a process of its own, its stderr to a file."""
    command = [sys.executable, "-m", "grpokit", "train", f"--model={model}", f"--environment=openenv:{url}",
               "--environment_args={episodes: 8, prompt: 'Guess:'}", f"--output_dir={output_dir}", "--seed=10",
               "--prompts_per_step=2", "--num_generations=4", "--max_completion_length=24",
               f"--max_steps={max_steps}", "--progress_bar=false", "--mixed_precision=no"]
    with open(stderr, "w") as err:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=PATH)


def exits_after(fault: str, ready: Callable[[Path], bool], process: subprocess.Popen, run: Path,
                cause: Callable[[], None] = lambda: None) -> int:
    """Once ``ready(run)`` (within 180 s; fails if the process ends first), ``cause()`` the fault: the process must
    then exit within 30 s. Its exit status."""
    deadline = time.monotonic() + 180
    try:
        while not ready(run):
            assert process.poll() is None or ready(run), f"the run ended (exit {process.returncode}) before {fault}"
            assert time.monotonic() < deadline, f"no {fault} after 180 s"
            time.sleep(0.1)
        cause()
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the failed run was still running 30 s after {fault}")
    finally:
        process.kill()
        process.wait()


def test_a_run_whose_server_is_killed_exits_with_its_error(tmp_path, tiny_model_dir):
    """The server killed after the run's first step: the next reset or step fails, and the process exits
    nonzero within 30 s, its error naming the server and the checkpoint to resume from."""
    stderr, run = tmp_path / "stderr.txt", tmp_path / "run"
    with serving(tmp_path) as (url, server):
        code = exits_after("the first step", lambda run: (run / "metrics.jsonl").exists()
                           and (run / "metrics.jsonl").read_text().strip() != "",
                           train(url, tiny_model_dir, run, stderr, max_steps=1000), run, cause=server.kill)
    text = stderr.read_text()
    assert code != 0, text[-3000:]
    assert f"openenv {url}, episode seed" in text and "raised" in text, text[-3000:]
    assert "checkpoint" in text and "continue with --resume latest" in text, text[-3000:]


def test_a_run_on_a_server_at_capacity_exits_with_its_error(tmp_path, tiny_model_dir):
    """A server that holds 2 sessions, a rollout of 8 episodes: the resets it refuses fail the run, which exits
    nonzero within 30 s of saying so, the sessions it did open notwithstanding."""
    stderr, run = tmp_path / "stderr.txt", tmp_path / "run"
    with serving(tmp_path, sessions=2) as (url, _):
        code = exits_after("its error", lambda _: "CAPACITY_REACHED" in stderr.read_text(),
                           train(url, tiny_model_dir, run, stderr, max_steps=2), run)
    text = stderr.read_text()
    assert code != 0, text[-3000:]
    assert f"openenv {url}, episode seed" in text and "max_concurrent_envs=N" in text, text[-3000:]
