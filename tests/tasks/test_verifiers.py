"""verifiers environments (``environment: verifiers:NAME``): the rows as verifiers formats them, the rubric's scores
through grpokit's reward calling equal to verifiers' own, episodes driven turn by turn giving verifiers' own rollout's
messages and state, the errors that name what is wrong, and two training steps on one.

Two small environments are written here as modules that ``load_environment`` finds by name, as it finds an installed
one: a single-turn quiz (two rubric functions, one async, weighted) and a multi-turn guessing game (higher/lower).
Run in verifiers' own environment: bash scripts/test_verifiers.sh (these tests are marked ``verifiers``)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.verifiers
vf = pytest.importorskip("verifiers", reason="verifiers is not installed: bash scripts/test_verifiers.sh")

from grpokit import GRPOConfig, GRPOTrainer  # noqa: E402
from grpokit.cli.main import main  # noqa: E402
from grpokit.rewards.calling import RewardError, score_completions  # noqa: E402
from grpokit.tasks.environments import load_environment_task  # noqa: E402
from grpokit.tasks.tiny_model import TinyModelSpec, build_model  # noqa: E402
from helpers import CHAT_TEMPLATE  # noqa: E402

QUIZ = '''
import verifiers as vf
from datasets import Dataset

QUESTIONS = [("2+2", "4"), ("3+4", "7"), ("5+1", "6"), ("9-3", "6"), ("8/2", "4")]

def load_environment(num_train_examples=-1, reward_type="float"):
    rows = [{"question": q, "answer": a, "info": {"n": i}} for i, (q, a) in enumerate(QUESTIONS)]
    if num_train_examples > 0:
        rows = rows[:num_train_examples]
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def exact(completion, answer, parser) -> float:
        if reward_type == "text":
            return "one"
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    async def brevity(completion, info, **kwargs) -> float:
        return 1.0 / (1 + len(completion[-1].content)) + info["n"] / 10

    rubric = vf.Rubric(funcs=[exact, brevity], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:2]),
                            system_prompt="Answer inside <answer></answer>.",
                            few_shot=[{"role": "user", "content": "1+1"},
                                      {"role": "assistant", "content": "<answer>2</answer>"}],
                            parser=parser, rubric=rubric)
'''

GUESS = '''
import verifiers as vf
from datasets import Dataset

class Guess(vf.MultiTurnEnv):
    def __init__(self, fail_on=None, **kwargs):
        super().__init__(**kwargs)
        self.fail_on = fail_on

    async def setup_state(self, state):
        if self.fail_on == "setup":
            raise KeyError("no board")
        state["guesses"] = []
        return state

    async def env_response(self, messages, state, **kwargs):
        if self.fail_on == "reply":
            raise ValueError("the board broke")
        if self.fail_on == "model":  # a simulated user would ask a model; grpokit's policy is not one to ask
            await self.get_model_response(state, messages)
        text = messages[-1].content.strip()
        guess = int(text) if text.lstrip("-").isdigit() else None
        state["guesses"].append(guess)
        if guess is None:
            return [vf.UserMessage(content="a number, please")]
        if guess == int(state["answer"]):  # the env's last word: the episode ends with it
            state["final_env_response"] = [vf.UserMessage(content="right")]
            return state["final_env_response"]
        return [vf.UserMessage(content="higher" if guess < int(state["answer"]) else "lower")]

def load_environment(fail_on=None, max_turns=4, seed=0):
    rows = [{"question": "Guess my number (1-10).", "answer": a, "info": {"seed": seed}} for a in ("7", "3")]

    def solved(state) -> float:
        return 1.0 if state["guesses"] and state["guesses"][-1] == int(state["answer"]) else 0.0

    async def guesses_made(state) -> int:
        return len(state["guesses"])

    def fewer_than_others(states) -> list[float]:  # a group function: the states of one example
        mean = sum(len(s["guesses"]) for s in states) / len(states)
        return [float(len(s["guesses"]) < mean) for s in states]

    rubric = vf.Rubric(funcs=[solved, guesses_made, fewer_than_others], weights=[1.0, -0.1, 0.2])
    return Guess(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=max_turns, fail_on=fail_on,
                 system_prompt="Guess the number; answer with the number alone.")
'''

TOOLS = '''
import verifiers as vf
from datasets import Dataset

def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b

def load_environment():
    return vf.ToolEnv(dataset=Dataset.from_list([{"question": "1+2?", "answer": "3"}]), tools=[add])
'''


@pytest.fixture
def envs(tmp_path, monkeypatch):
    """The test environments as importable modules, as an installed verifiers environment is."""
    for module, source in {"vf_quiz": QUIZ, "vf_guess": GUESS, "vf_tools": TOOLS}.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


class ScriptedModel(vf.Client):
    """A verifiers client whose model answers with the given turns, one per call: verifiers' own loop, fed the
    turns grpokit's episodes are given."""

    def __init__(self, turns):
        super().__init__(None)
        self.turns = list(turns)

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        return self.turns.pop(0)

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, text):
        message = vf.ResponseMessage(content=text, finish_reason="stop", is_truncated=False, tokens=None)
        return vf.Response(id="x", created=0, model="m", message=message)

    async def close(self):
        return None


def verifiers_own(env, rows, scripts):
    """verifiers' rollout of each row with its scripted turns, each example's group scored by the rubric (as
    verifiers' generate scores a group): the states."""
    async def run():
        states = [await env.rollout(row, ScriptedModel(turns), "m") for row, turns in zip(rows, scripts)]
        for example in {s["example_id"] for s in states}:
            await env.rubric.score_group([s for s in states if s["example_id"] == example])
        return states
    return asyncio.run(run())


def grpokit_scores(task, rows, completions, episodes):
    total, per_function = score_completions(task.reward_funcs, task.reward_weights, [r["prompt"] for r in rows],
                                            completions, {"answer": [r["answer"] for r in rows],
                                                          "environments": episodes})
    return total.tolist(), {name: values.tolist() for name, values in per_function.items()}


def test_rows_are_the_environments_dataset_as_verifiers_formats_it(envs):
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    task = load_environment_task("verifiers:vf-quiz", {"num_train_examples": 3})
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # verifiers' put back
    env = vf.load_environment("vf-quiz", num_train_examples=3)
    assert len(task.rows) == 3 and task.rows == env.get_dataset().to_list()
    assert task.rows[1]["prompt"] == [{"role": "system", "content": "Answer inside <answer></answer>."},
                                      {"role": "user", "content": "1+1"},
                                      {"role": "assistant", "content": "<answer>2</answer>"},
                                      {"role": "user", "content": "3+4"}]
    assert (task.rows[1]["answer"], task.rows[1]["info"], task.rows[1]["example_id"]) == ("7", {"n": 1}, 1)
    assert task.eval_rows == env.get_eval_dataset().to_list() and len(task.eval_rows) == 2
    # the rubric's functions, and the metric every MultiTurnEnv adds (weight 0: logged, not rewarded)
    assert [f.__name__ for f in task.reward_funcs] == ["exact", "brevity", "num_turns"]
    assert task.reward_weights == [1.0, 0.5, 0.0]
    assert task.info["environment_class"] == "SingleTurnEnv" and task.info["verifiers"] == vf.__version__
    assert not hasattr(task.environment_factory(), "reply")  # a single turn: no reply


def test_single_turn_scores_equal_verifiers_own(envs):
    task = load_environment_task("verifiers:vf-quiz", {})
    env = vf.load_environment("vf-quiz")
    rows = [task.rows[i] for i in (0, 0, 1, 3, 4)]
    completions = ["<answer>4</answer>", "<answer>5</answer>", "I think <answer>7</answer>", "6", ""]
    episodes = []
    for row, completion in zip(rows, completions):
        episode = task.environment_factory()
        episode.reset(**row)
        episode.end(completion)
        episodes.append(episode)
    total, per_function = grpokit_scores(task, rows, completions, episodes)
    states = verifiers_own(env, rows, [[c] for c in completions])
    for name in ("exact", "brevity"):
        assert per_function[name] == pytest.approx([s["metrics"][name] for s in states], abs=1e-6)
    assert total == pytest.approx([s["reward"] for s in states], abs=1e-6)
    assert per_function["exact"] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert [e.state["completion"] for e in episodes] == [s["completion"] for s in states]


def test_without_episodes_a_completion_is_replayed_as_its_rows_last_turn(envs):
    task = load_environment_task("verifiers:vf-quiz", {})
    rows, completions = task.rows[:2], ["<answer>4</answer>", "<answer>8</answer>"]
    total, per_function = score_completions(
        task.reward_funcs, task.reward_weights, [r["prompt"] for r in rows], completions,
        {key: [r[key] for r in rows] for key in ("answer", "info", "example_id")})
    states = verifiers_own(vf.load_environment("vf-quiz"), rows, [[c] for c in completions])
    assert total.tolist() == pytest.approx([s["reward"] for s in states], abs=1e-6)
    assert per_function["exact"].tolist() == [1.0, 0.0]


def play(task, row, turns):
    """An episode driven as grpokit's rollout drives it: reset, reply after each turn until it answers None (the
    rest of the turns unsaid), end with the last turn no reply saw."""
    episode = task.environment_factory()
    episode.reset(**row)
    said = []
    for turn in turns:
        said.append(episode.reply(turn))
        if said[-1] is None:
            break
    episode.end(None)
    return episode, said


def test_multi_turn_episodes_match_verifiers_own_rollout(envs):
    task = load_environment_task("verifiers:vf-guess", {})
    env = vf.load_environment("vf-guess")
    rows = [task.rows[0], task.rows[0], task.rows[0], task.rows[1]]
    scripts = [["5", "8", "7"], ["7"], ["2", "1", "x", "9"], ["3"]]
    played = [play(task, row, turns) for row, turns in zip(rows, scripts)]
    assert [said for _, said in played] == [["higher", "lower", None], [None], ["higher", "higher",
                                                                                "a number, please", None], [None]]
    states = verifiers_own(env, rows, scripts)
    for (episode, _), state in zip(played, states):
        assert episode.state["completion"] == state["completion"]
        assert episode.state["guesses"] == state["guesses"]
        assert episode.state["stop_condition"] == state["stop_condition"]
        assert len(episode.state["trajectory"]) == len(state["trajectory"])
    assert [s["stop_condition"] for s in states] == ["has_final_env_response", "has_final_env_response",
                                                     "max_turns_reached", "has_final_env_response"]
    assert [m.content for m in played[0][0].state["completion"]] == ["5", "higher", "8", "lower", "7", "right"]
    total, per_function = grpokit_scores(task, rows, ["?"] * 4, [episode for episode, _ in played])
    for name in ("solved", "guesses_made", "fewer_than_others", "num_turns"):
        assert per_function[name] == pytest.approx([s["metrics"][name] for s in states], abs=1e-6)
    assert total == pytest.approx([s["reward"] for s in states], abs=1e-6)
    assert per_function["fewer_than_others"] == [0.0, 1.0, 0.0, 0.0]  # grouped by example: row 1 alone
    assert dict(zip([f.__name__ for f in task.reward_funcs], task.reward_weights))["num_turns"] == 0.0


def test_the_runs_seed_goes_to_a_load_environment_that_takes_one(envs):
    assert load_environment_task("verifiers:vf-guess", {}, seed=5).rows[0]["info"] == {"seed": 5}
    assert load_environment_task("verifiers:vf-guess", {"seed": 2}, seed=5).rows[0]["info"] == {"seed": 2}


def test_episodes_driven_from_threads_at_once_are_those_driven_one_by_one(envs):
    task = load_environment_task("verifiers:vf-guess", {})
    scripts = [["5", "8", "7"], ["2", "3"], ["9", "1", "x"], ["3"]] * 4
    rows = [task.rows[0], task.rows[1], task.rows[0], task.rows[1]] * 4
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda args: play(task, *args), zip(rows, scripts)))
    alone = [play(task, row, turns) for row, turns in zip(rows, scripts)]
    assert [said for _, said in together] == [said for _, said in alone]
    assert [e.state["completion"] for e, _ in together] == [e.state["completion"] for e, _ in alone]


def test_an_environment_asking_the_model_itself_ends_its_episode_saying_so(envs):
    task = load_environment_task("verifiers:vf-guess", {"fail_on": "model"})
    episode = task.environment_factory()
    episode.reset(**task.rows[0])
    with pytest.warns(UserWarning, match=r"'vf-guess'.*asked the rollout's model for a response itself"):
        assert episode.reply("5") is None
    episode.end(None)
    assert episode.state["stop_condition"] == "has_error" and episode.reply("6") is None


def test_an_episode_cut_short_keeps_its_last_turn(envs):
    """The completion ran out of tokens (or of turns): end() gets the turn no reply saw, as verifiers records a
    truncated last response."""
    task = load_environment_task("verifiers:vf-guess", {})
    episode = task.environment_factory()
    episode.reset(**task.rows[0])
    assert episode.reply("5") == "higher"
    episode.end("6")
    assert [m.content for m in episode.state["completion"]] == ["5", "higher", "6"]
    assert episode.state["guesses"] == [5]  # no env_response for a turn that ended the completion


def test_verifiers_not_installed_or_the_wrong_version_is_named(envs, monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ValueError, match=r"verifiers is not installed: pip install 'grpokit\[verifiers\]'"):
        load_environment_task("verifiers:vf-quiz")
    monkeypatch.undo()
    monkeypatch.setattr(vf, "__version__", "0.4.0")
    with pytest.raises(ValueError, match=r"verifiers 0\.4\.0 is installed.*0\.3\.x.*verifiers>=0\.3,<0\.4"):
        load_environment_task("verifiers:vf-quiz")
    with pytest.raises(ValueError, match=r"0\.4\.0 is installed: its environments.*run as agents.*"
                                         r"grpokit\.agents\.verifiers_v1\.verifiers_v1_task"):
        load_environment_task("verifiers:vf-quiz")
    monkeypatch.setattr(vf, "__version__", "0.5.0")
    with pytest.raises(ValueError, match=r"verifiers 0\.5\.0 is installed; .*0\.3\.x.*verifiers>=0\.3,<0\.4"):
        load_environment_task("verifiers:vf-quiz")


def test_an_environment_not_installed_or_failing_to_load_is_named(envs, tmp_path):
    with pytest.raises(ValueError, match=r"'no-such-env' is not installed \(no module 'no_such_env'\).*vf-install"):
        load_environment_task("verifiers:no-such-env")
    (tmp_path / "vf_broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"'vf-broken'.*'vf_broken' failed to import: ModuleNotFoundError.*"
                                         r"not_a_module_anywhere"):
        load_environment_task("verifiers:vf-broken")
    with pytest.raises(ValueError, match=r"'vf-quiz' failed to load with environment_args \{'num_examples': 2\}"
                                         r".*unexpected keyword argument 'num_examples'"):
        load_environment_task("verifiers:vf-quiz", {"num_examples": 2})
    with pytest.raises(ValueError, match=r"'vf-tools' is a ToolEnv.*does not run yet"):
        load_environment_task("verifiers:vf-tools")


def test_an_environment_raising_in_reset_or_reply_is_named_with_its_row(envs):
    task = load_environment_task("verifiers:vf-guess", {"fail_on": "setup"})
    with pytest.raises(ValueError, match=r"'vf-guess' raised KeyError: 'no board' in reset.*'answer': '7'"):
        task.environment_factory().reset(**task.rows[0])
    task = load_environment_task("verifiers:vf-guess", {"fail_on": "reply"})
    episode = task.environment_factory()
    episode.reset(**task.rows[1])
    with pytest.raises(ValueError, match=r"'vf-guess' raised ValueError: the board broke in reply.*'answer': '3'"):
        episode.reply("5")


def test_a_rubric_function_returning_no_number_is_named(envs):
    task = load_environment_task("verifiers:vf-quiz", {"reward_type": "text"})
    episode = task.environment_factory()
    episode.reset(**task.rows[0])
    episode.end("<answer>4</answer>")
    with pytest.raises(RewardError, match=r"rubric function 'exact' of verifiers environment 'vf-quiz' returned "
                                          r"str 'one'"):
        grpokit_scores(task, task.rows[:1], ["<answer>4</answer>"], [episode])


def test_two_training_steps_on_a_single_turn_environment(envs, tokenizer, tmp_path):
    task = load_environment_task("verifiers:vf-quiz", {})
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                                 max_positions=256), seed=0)
    # The rewarded functions (weight 0, num_turns, is a metric): two, as many as the config's default reward_funcs,
    # which config.reward_weights is checked against (callables in the config would not go into its checkpoint).
    funcs, weights = zip(*[(f, w) for f, w in zip(task.reward_funcs, task.reward_weights) if w])
    config = GRPOConfig(output_dir=str(tmp_path / "run"), prompts_per_step=2, num_generations=4,
                        max_completion_length=6, max_steps=2, micro_batch_size=8, progress_bar=False,
                        mixed_precision="no", reward_weights=list(weights))
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, train_dataset=task.rows, reward_funcs=list(funcs),
                          environment_factory=task.environment_factory)
    history = trainer.train()
    assert len(history) == 2 and all(0 <= m["rewards/exact"] <= 1 and m["rewards/brevity"] > 0 for m in history)


def test_a_multi_turn_environment_trains_from_the_config(envs, tokenizer, tmp_path):
    """environment: verifiers:NAME alone: its rows, its rubric (each function logged under its name) and its turns,
    the environment's replies inserted between the model's turns."""
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                                 max_positions=256), seed=0)
    config = GRPOConfig(output_dir=str(tmp_path / "run"), environment="verifiers:vf-guess",
                        environment_args={"max_turns": 3}, prompts_per_step=2, num_generations=4,
                        max_completion_length=24, max_steps=2, temperature=1.5, progress_bar=False,
                        mixed_precision="no")
    history = GRPOTrainer(config, model=model, tokenizer=tokenizer).train()
    assert all({"rewards/solved", "rewards/guesses_made", "rewards/fewer_than_others"} <= set(m) for m in history)
    assert sum(m.get("env_replies", 0) for m in history) > 0


def test_the_cli_trains_on_an_environment_named_alone(envs, tokenizer, tmp_path):
    """grpokit train --environment verifiers:NAME --environment_args {...}: the command line's route to the same run
    (a saved model, as a user's checkpoint is)."""
    tokenizer.chat_template = CHAT_TEMPLATE
    build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                         max_positions=256), seed=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert main(["train", f"--model={tmp_path / 'model'}", "--environment=verifiers:vf-guess",
                 "--environment_args={max_turns: 3}", f"--output_dir={tmp_path / 'run'}", "--prompts_per_step=2",
                 "--num_generations=4", "--max_completion_length=24", "--max_steps=2", "--temperature=1.5",
                 "--progress_bar=false", "--mixed_precision=no"]) == 0
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all({"rewards/solved", "rewards/guesses_made"} <= set(m) for m in history)
    assert sum(m.get("env_replies", 0) for m in history) > 0


@pytest.mark.parametrize("eval_reward, key", [(None, "rubric"), ("exact", "exact")])
def test_held_out_rows_are_judged_by_the_rubric_or_one_of_its_functions(envs, tokenizer, tmp_path, eval_reward,
                                                                        key):
    """The environment's eval_dataset is the held-out set; eval_reward names a rubric function, or none: the rubric's
    weighted total judges (solved: 1 or more)."""
    from grpokit.resolve import eval_judge

    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                                 max_positions=256), seed=0)
    config = GRPOConfig(output_dir=str(tmp_path / "run"), environment="verifiers:vf-quiz", eval_every=1,
                        eval_reward=eval_reward, prompts_per_step=2, num_generations=2, max_completion_length=6,
                        max_steps=1, progress_bar=False, mixed_precision="no")
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    held_out = load_environment_task("verifiers:vf-quiz").eval_rows
    assert sorted(map(str, trainer.held_out.rows)) == sorted(map(str, held_out))
    assert trainer.held_out.judge.__name__ == key or eval_judge(config, [], trainer.environment).__name__ == key
    history = trainer.train()
    assert 0 <= history[-1]["eval_accuracy"] <= 1 and history[-1]["eval_score"] >= 0


@pytest.mark.parametrize("fail_on, error", [("setup", "raised KeyError: 'no board' in reset"),
                                            ("reply", "raised ValueError: the board broke in reply")])
def test_a_run_whose_environment_fails_exits_with_its_error(envs, tokenizer, tmp_path, fail_on, error):
    """A real interpreter (python -m grpokit train) whose verifiers environment raises in reset or in reply: the
    process exits nonzero within 60 s of its error, which names the environment and the call (a run that raises
    inside pytest's process would never show whether the exit waits on a thread)."""
    tokenizer.chat_template = CHAT_TEMPLATE
    build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                         max_positions=256), seed=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    command = [sys.executable, "-m", "grpokit", "train", f"--model={tmp_path / 'model'}",
               "--environment=verifiers:vf-guess", f"--environment_args={{fail_on: {fail_on}, max_turns: 3}}",
               f"--output_dir={tmp_path / 'run'}", "--prompts_per_step=2", "--num_generations=2",
               "--max_completion_length=24", "--max_steps=2", "--temperature=1.5", "--progress_bar=false",
               "--mixed_precision=no"]
    # this interpreter's import path, the environments' modules (tmp_path) first
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=environ)
    try:
        deadline = time.monotonic() + 300
        while error not in stderr.read_text() and process.poll() is None:
            assert time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.1)
        code = process.wait(timeout=60)
    finally:
        process.kill()
        process.wait()
    text = stderr.read_text()
    assert code != 0 and error in text and "'vf-guess'" in text, text[-3000:]
