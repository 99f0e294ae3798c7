"""Reward functions are called as TRL calls them (by keyword, columns by name, conversational completions as
messages), checked before the model loads, and loadable from a file or module named in the config."""

import sys
import textwrap

import pytest

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.cli.main import main
from grpokit.resolve import resolve_reward_functions
from grpokit.rewards.builtin import accuracy_reward, format_reward
from grpokit.rewards.calling import (
    RewardError,
    RewardLog,
    TrainerState,
    accepted_keywords,
    check_reward_functions,
    score_completions,
    score_steps,
)
from grpokit.tasks.arithmetic import arithmetic_steps_reward
from helpers import CHAT_TEMPLATE, make_trainer


def recording(name, signature="completions, **kwargs"):
    """A reward function with the given parameters that records what it was passed and scores 0."""
    calls = []
    namespace = {"calls": calls}
    exec(f"def {name}({signature}):\n    calls.append(dict(locals()))\n    return [0.0] * len(completions)",
         namespace)
    return namespace[name], calls


def test_trl_first_example_takes_completions_only():
    def reward_len(completions, **kwargs):  # TRL's GRPO docs, first example
        return [-abs(20 - len(completion)) for completion in completions]

    total, _ = score_completions([reward_len], [1.0], ["q", "q"], ["x" * 20, "x" * 5], {})
    assert total.tolist() == [0.0, -15.0]


def test_keywords_columns_ids_and_state_reach_the_function():
    fn, calls = recording("everything", "prompts, completions, completion_ids, trainer_state, solution, **kwargs")
    state = TrainerState(global_step=3, max_steps=10, epoch=1)
    score_completions([fn], [1.0], ["p0", "p1"], ["c0", "c1"], {"solution": ["4", "5"], "level": [1, 2]},
                      completion_ids=[[7, 8], [9]], trainer_state=state)
    (call,) = calls
    assert call["prompts"] == ["p0", "p1"] and call["completions"] == ["c0", "c1"]
    assert call["completion_ids"] == [[7, 8], [9]] and call["trainer_state"] is state
    hooks = {name: call["kwargs"].pop(name) for name in ("log_metric", "log_extra")}  # TRL's logging hooks
    assert call["solution"] == ["4", "5"] and call["kwargs"] == {"level": [1, 2]}
    assert all(callable(hook) for hook in hooks.values())


def test_a_function_without_kwargs_gets_only_what_it_names():
    fn, calls = recording("strict", "completions, level")
    score_completions([fn], [1.0], ["p"], ["c"], {"level": [1], "other": [2]}, completion_ids=[[1]],
                      trainer_state=TrainerState())
    assert calls == [{"completions": ["c"], "level": [1]}]


def test_conversational_prompts_get_message_completions_and_builtins_read_both():
    prompts = [[{"role": "user", "content": "What is 47 + 85?"}]] * 2 + ["What is 47 + 85?"]
    completions = ["<think>\n7+5=12\n4+8+1=13\n</think>\n<answer>132</answer>", "<answer>122</answer>",
                   "<think>\n7+5=12\n4+8+1=13\n</think>\n<answer>132</answer>"]
    fn, calls = recording("seen")
    score_completions([fn], [1.0], prompts, completions, {})
    assert calls[0]["completions"][:2] == [[{"role": "assistant", "content": c}] for c in completions[:2]]
    assert calls[0]["completions"][2] == completions[2] and calls[0]["kwargs"]["prompts"] == prompts

    total, per_fn = score_completions([accuracy_reward, format_reward], [1.0, 1.0], prompts, completions,
                                      {"answer": ["132"] * 3})
    assert per_fn["accuracy_reward"].tolist() == [1.0, 0.0, 1.0] and per_fn["format_reward"].tolist() == [1.0, 0, 1.0]
    _, _, steps = score_steps([arithmetic_steps_reward], [1.0], prompts, completions, {})
    assert steps[0] == steps[2] and [r for _, r in steps[0]] == [1.0, 1.0, 1.0]


def test_the_trainer_passes_raw_prompts_named_columns_ids_and_the_step(tokenizer, tiny_model, tmp_path):
    """TRL's ``acc(completions, solution, **kwargs)``: once silently zero here (positional call, the answer column
    renamed); now ``solution`` arrives under its own name, and as ``answer``."""
    fn, calls = recording("acc", "completions, solution, **kwargs")
    rows = [{"prompt": f"Count {i}:", "solution": str(i), "level": i % 3} for i in range(8)]
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, reward_funcs=[fn], answer_column="solution",
                           system_prompt="Be brief.", prompts_per_step=2, num_generations=2, max_steps=2)
    trainer.train()
    assert [c["kwargs"]["trainer_state"].global_step for c in calls] == [0, 1]
    call = calls[0]
    kwargs = call["kwargs"]
    assert all(p.startswith("Count ") for p in kwargs["prompts"])  # as in the dataset, not rendered
    by_prompt = {row["prompt"]: row for row in rows}
    assert call["solution"] == [by_prompt[p]["solution"] for p in kwargs["prompts"]] == kwargs["answer"]
    assert kwargs["level"] == [by_prompt[p]["level"] for p in kwargs["prompts"]]
    ids = kwargs["completion_ids"]
    assert [tokenizer.decode(i, skip_special_tokens=True) for i in ids] == call["completions"]
    assert kwargs["trainer_state"].max_steps == 2 and kwargs["trainer_state"].epoch == 1


def test_conversational_training_rewards_read_the_assistant_message(tokenizer, tiny_model, tmp_path):
    tokenizer.chat_template = CHAT_TEMPLATE
    fn, calls = recording("seen")
    rows = [{"prompt": [{"role": "user", "content": f"Count {i}"}]} for i in range(4)]
    make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, reward_funcs=[fn], prompts_per_step=2,
                 num_generations=2, max_steps=1).train()
    completions = calls[0]["completions"]
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
               for c in completions)
    assert all(p[0]["content"].startswith("Count ") for p in calls[0]["kwargs"]["prompts"])


def positional_only(prompts, completions, /):
    return [0.0] * len(completions)


def typo(completions, soluton, **kwargs):
    return [0.0] * len(completions)


def old_style(p, c, **kwargs):
    return [0.0] * len(c)


@pytest.mark.parametrize("fn, rows, message", [
    (positional_only, None, "reward function 'positional_only' takes 'prompts' by position only; reward functions "
                            "are called by keyword"),
    (typo, None, "reward function 'typo' needs 'soluton', which is neither a reward argument (prompts, completions, "
                 "completion_ids, trainer_state, log_extra, log_metric) nor a column of train_dataset"),
    (typo, None, "did you mean 'solution'?"),
    (old_style, None, "reward function 'old_style' needs 'p'"),
    (format_reward, [{"prompt": "q", "completions": "x"}], "train_dataset: column 'completions' has the name of an "
                                                            "argument every reward function is passed"),
])
def test_signatures_are_checked_before_the_model_loads(fn, rows, message):
    rows = rows or [{"prompt": "q", "solution": "1"}]
    config = GRPOConfig(model="no/such/model", progress_bar=False)  # reached only if the check passed
    with pytest.raises(ValueError) as error:
        GRPOTrainer(config, train_dataset=rows, reward_funcs=[fn])
    assert message in str(error.value)


def test_a_missing_answer_column_is_named_as_the_data_has_it():
    config = GRPOConfig(model="no/such/model", answer_column="solution", progress_bar=False)
    with pytest.raises(ValueError, match=r"row 0 has no column 'solution'"):
        GRPOTrainer(config, train_dataset=[{"prompt": "q", "answer": "1"}], reward_funcs=["accuracy"])


REWARDS_PY = textwrap.dedent("""
    def brevity(completions, **kwargs):
        return [-len(c) / 100 for c in completions]

    def shouting(completions, **kwargs):
        return [float(c.isupper()) for c in completions]

    THRESHOLD = 3
""")


def test_rewards_from_a_file_and_a_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(REWARDS_PY.replace("brevity", "score"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    funcs, weights = resolve_reward_functions(["accuracy", "my_rewards.py:brevity", "my_rewards.py:shouting",
                                               "pkg.scores:score"], [1.0, 0.5, 1.0, 2.0])
    assert [f.__name__ for f in funcs] == ["accuracy_reward", "brevity", "shouting", "score"]
    assert funcs[1].__module__ == funcs[2].__module__  # one file, loaded once
    assert funcs[1](completions=["abcd"]) == [-0.04] and weights == [1.0, 0.5, 1.0, 2.0]
    sys.modules.pop("pkg.scores", None), sys.modules.pop("pkg", None)


def test_the_built_in_process_rewards_resolve_by_name():
    funcs, _ = resolve_reward_functions(["arithmetic_steps", "arithmetic_substeps"])
    assert [f.__name__ for f in funcs] == ["arithmetic_steps_reward", "arithmetic_substeps_reward"]


@pytest.mark.parametrize("spec, message", [
    ("nowhere.py:brevity", "reward_funcs: 'nowhere.py:brevity': file 'nowhere.py' does not exist"),
    ("my_rewards.py:brevty", "'my_rewards.py' has no attribute 'brevty'; did you mean 'brevity'?"),
    ("my_rewards.py:THRESHOLD", "my_rewards.py:THRESHOLD is a int, not a function"),
    ("broken.py:f", "importing 'broken.py' raised ZeroDivisionError"),
    ("no_such_pkg.rewards:f", "cannot import module 'no_such_pkg.rewards'"),
    ("acuracy", "unknown reward 'acuracy'; did you mean 'accuracy'?"),
    ("my_rewards.py:", "must be 'path/to/file.py:name' or 'package.module:name'"),
])
def test_reward_paths_fail_clearly(tmp_path, monkeypatch, spec, message):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        resolve_reward_functions([spec])
    assert message in str(error.value)


def test_cli_trains_with_a_reward_from_a_file(tmp_path, tiny_model_dir, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "What is {a} + 1?", "answer": "{a + 1}"}}\n'
                                                  for a in range(8)))
    monkeypatch.chdir(tmp_path)
    args = ["train", f"--model={tiny_model_dir}", "--dataset=train.jsonl", "--output_dir=run", "--prompts_per_step=2",
            "--num_generations=2", "--max_completion_length=4", "--max_steps=1", "--progress_bar=false"]
    assert main([*args, "--reward_funcs=[accuracy, my_rewards.py:brevity]"]) == 0
    assert "rewards/brevity" in (tmp_path / "run" / "metrics.jsonl").read_text()
    assert main([*args, "--output_dir=run2", "--reward_funcs", "[accuracy, my_rewards.py:brevty]"]) == 2  # spaced
    assert "did you mean 'brevity'" in capsys.readouterr().err


# ---- calling, checking and combining, each piece alone ------------------------------------------------------


def test_what_a_function_takes_and_which_columns_it_requires():
    def loose(completions, solution, level=1, *args, **kwargs):
        return [0.0] * len(completions)

    def strict(prompts, solution, hint, *, tag=None):
        return [0.0] * len(prompts)

    assert accepted_keywords(loose) is None and accepted_keywords(max) is None  # **kwargs; no signature
    assert accepted_keywords(strict) == {"prompts", "solution", "hint", "tag"}
    assert check_reward_functions([loose, strict, max], ["solution", "hint", "level"], "d") == ["solution", "hint"]
    with pytest.raises(ValueError, match=r"d: column 'prompts' has the name of an argument every reward function is "
                                         r"passed \(prompts, completions, completion_ids, trainer_state, log_extra, "
                                         r"log_metric\); rename"):
        check_reward_functions([loose], ["solution", "prompts"], "d")
    with pytest.raises(ValueError, match=r"reward function 'strict' needs 'hint', which is neither a reward argument "
                                         r"\(prompts, completions, completion_ids, trainer_state, log_extra, "
                                         r"log_metric\) nor a column of d "
                                         r"\(its columns: \['solution'\]\)$"):
        check_reward_functions([strict], ["solution"], "d")


def batch_only_fails(completions, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("the batch")
    return [len(completions[0])]


def test_a_batch_that_fails_where_each_completion_alone_scores():
    with pytest.raises(RewardError, match=r"'batch_only_fails' raised RuntimeError: the batch on the batch of 2 "
                                          r"completions, though each completion alone scores"):
        score_completions([batch_only_fails], [1.0], ["q", "q"], ["a", "bc"], {})
    errors = []
    total, _ = score_completions([batch_only_fails], [1.0], ["q", "q"], ["a", "bc"], {}, on_error="skip",
                                 errors=errors)
    assert total.tolist() == [1.0, 2.0] and errors == []

    def single_is_wrong(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("the batch")
        return [1.0, 2.0]

    with pytest.raises(RewardError, match=r"'single_is_wrong' returned \[1.0, 2.0\] for 1 completion; expected a "
                                          r"list of 1"):
        score_completions([single_is_wrong], [1.0], ["q", "q"], ["a", "b"], {}, on_error="skip")


def test_a_failing_completion_is_skipped_without_an_error_list():
    def fails_on_b(completions, **kwargs):
        if "b" in completions:
            raise ValueError("b")
        return [1.0] * len(completions)

    _, per_function = score_completions([fails_on_b], [1.0], ["q", "q"], ["a", "b"], {}, on_error="skip")
    assert per_function["fails_on_b"][0] == 1.0 and per_function["fails_on_b"][1].isnan()


def test_outcome_totals_are_weighted_sums_over_the_functions_that_applied():
    def first(completions, **kwargs):
        return [1.0, None, 0.5]

    def second(completions, **kwargs):
        return [None, None, 2]

    total, per_function = score_completions([first, second], [2.0, 0.5], ["q"] * 3, ["a", "b", "c"], {})
    assert total.tolist() == [2.0, 0.0, 2.0]  # 2·1; nothing applied: 0; 2·0.5 + 0.5·2
    assert per_function["first"][[0, 2]].tolist() == [1.0, 0.5] and per_function["first"][1].isnan()
    assert per_function["second"][2] == 2.0 and per_function["second"][:2].isnan().all()


def test_steps_of_process_and_outcome_rewards_mix_by_their_weights():
    def process(completions, **kwargs):
        return [[(1, 1.0), (3, 0.5)], [], None]

    def outcome(completions, **kwargs):
        return [1.0, 2.0, None]

    completions = ["abc", "de", "x"]
    total, per_function, steps = score_steps([process, outcome], [1.0, 0.5], ["q"] * 3, completions, {})
    assert steps == [[(1, 1.0), (3, 1.0)], [(2, 1.0)], []]  # 0.5 + 0.5·1 where both end; the outcome at the end
    assert per_function["process"][0] == 0.75 and per_function["process"][1:].isnan().all()
    assert total.tolist() == [0.75 + 0.5, 1.0, 0.0]
    with pytest.raises(RewardError, match=r"'process' returned step rewards \(a list\) for completion 0: it is a "
                                          r"process reward; set supervision: process"):
        score_completions([process], [1.0], ["q"] * 3, completions, {})


@pytest.mark.parametrize("steps, message", [
    ([(0, 1.0), (3, 1.0)], None),  # the first and the last offsets are inside
    ([(4, 1.0)], r"step 0 of completion 0 ends at character 4, outside the completion's \[0, 3\]"),
    ([(-1, 1.0)], r"ends at character -1, outside"),
    ([(1, 1.0), (1,)], r"step 1 of completion 0 is \(1,\); expected a pair \(character offset where the step ends"),
    ([(1.0, 1.0)], r"step 0 of completion 0 is \(1.0, 1.0\); expected a pair"),
    ([(1, float("nan"))], r"returned nan for completion 0, step 0 \(prompt 'q', completion 'abc'\)"),
    ([(1, "1")], r"returned str '1' for completion 0, step 0; expected a float or None"),
])
def test_each_step_is_checked(steps, message):
    def process(completions, **kwargs):
        return [steps]

    if message is None:
        assert score_steps([process], [1.0], ["q"], ["abc"], {})[2] == [steps]
    else:
        with pytest.raises(RewardError, match=message):
            score_steps([process], [1.0], ["q"], ["abc"], {})


def test_a_callable_object_is_named_by_its_class():
    class LengthReward:  # an instance has no __name__: its metrics and errors name its class
        def __call__(self, completions, **kwargs):
            return [float(len(c)) for c in completions]

    _, per_function = score_completions([LengthReward()], [1.0], ["q"], ["ab"], {})
    assert list(per_function) == ["LengthReward"] and per_function["LengthReward"].tolist() == [2.0]


def test_what_reward_functions_log_is_kept_merged_and_averaged_by_name():
    """TRL's log_metric (scalars, averaged per step) and log_extra (columns, one value per completion), across the
    calls of a step: merged in call order, a call that logged nothing skipped; a metric whose name the step's own
    metrics hold goes under logged/NAME."""
    first, second = RewardLog(), RewardLog()
    first.log_metric("overlap", 1)
    first.log_metric(7, 0.5)
    first.log_extra("judge", ["a", "b"])
    second.log_metric("overlap", 0.0)
    second.log_extra("judge", ["c"])
    second.log_extra("why", [None])
    assert first.metrics == {"overlap": [1.0], "7": [0.5]} and isinstance(first.metrics["overlap"][0], float)
    merged = RewardLog.merge([None, first, None, second])
    assert merged.metrics == {"overlap": [1.0, 0.0], "7": [0.5]}
    assert merged.extra == {"judge": ["a", "b", "c"], "why": [None]}
    assert first.metrics == {"overlap": [1.0], "7": [0.5]} and first.extra == {"judge": ["a", "b"]}  # untouched
    assert merged.metric_means(iter(["7", "loss"])) == {"overlap": 0.5, "logged/7": 0.5}
    assert merged.metric_means([]) == {"overlap": 0.5, "7": 0.5}
    assert RewardLog.merge([None]) == RewardLog()

