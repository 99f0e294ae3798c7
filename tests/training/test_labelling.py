"""``grpokit sample``: G completions per prompt labelled by rule rewards, in the forms ``grpokit reward train``
reads (labelled rows, step rows from a process reward, preference pairs), and the chain sample → reward
train → GRPO with the trained reward model."""

import json

import pytest
import yaml

from grpokit import OutcomeRewardModel, ProcessRewardModel
from grpokit.cli.main import main
from grpokit.resolve import resolve_reward_functions
from grpokit.tasks.arithmetic import arithmetic_steps_reward
from grpokit.training.labelling import sample_rows
from helpers import TINY

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(12, 30), (47, 85), (20, 21), (33, 44)]]
REWARDS = '''
def has_a(completions, **kwargs):
    return [float("a" in c) for c in completions]


def odd(completions, **kwargs):
    """About half the completions: the parity of the sum of their characters' codes."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def line_steps(completions, **kwargs):
    """A step per line: 1 when the line holds an 'a'."""
    out = []
    for c in completions:
        steps, offset = [], 0
        for line in c.split("\\n"):
            offset += len(line)
            if line.strip():
                steps.append((offset, float("a" in line)))
            offset += 1
        out.append(steps)
    return out
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def sample(tiny_model, tokenizer, specs, **options):
    functions, weights = resolve_reward_functions(specs)
    values = dict(num_generations=4, max_new_tokens=12, seed=0, batch_size=3, progress=False)
    return sample_rows(tiny_model, tokenizer, ROWS, functions, weights, **{**values, **options})


def test_labelled_rows_carry_each_completions_reward(tiny_model, tokenizer, reward_file):
    rows, counts = sample(tiny_model, tokenizer, [f"{reward_file}:has_a", "format"])
    assert counts["completions"] == 16 and counts["unscored"] == 0 and len(rows) == 16
    assert [r["prompt"] for r in rows] == [row["prompt"] for row in ROWS for _ in range(4)]
    assert [r["answer"] for r in rows] == [row["answer"] for row in ROWS for _ in range(4)]
    for row in rows:
        assert set(row) == {"prompt", "completion", "label", "rewards", "answer"}  # no steps: outcome rewards only
        expected = float("a" in row["completion"])
        assert row["rewards"] == {"has_a": expected, "format_reward": 0.0} and row["label"] == expected
    assert len({r["completion"] for r in rows}) > 8  # sampled, not greedy
    again, _ = sample(tiny_model, tokenizer, [f"{reward_file}:has_a", "format"])
    assert again == rows  # seeded
    other, _ = sample(tiny_model, tokenizer, [f"{reward_file}:has_a", "format"], seed=1)
    assert other != rows


def test_a_process_reward_gives_step_rows(tiny_model, tokenizer):
    rows, _ = sample(tiny_model, tokenizer, ["arithmetic_steps"])
    assert rows and all(set(r) == {"prompt", "completion", "label", "rewards", "answer", "steps"} for r in rows)
    for row in rows:
        (expected,) = arithmetic_steps_reward([row["prompt"]], [row["completion"]])
        assert row["steps"] == [[end, reward] for end, reward in expected if end > 0]
        assert row["label"] == pytest.approx(sum(r for _, r in expected) / len(expected))


def test_pairs_pair_higher_with_lower_rewards_within_a_group(tiny_model, tokenizer, reward_file):
    labelled, _ = sample(tiny_model, tokenizer, [f"{reward_file}:odd"], num_generations=6)
    pairs, counts = sample(tiny_model, tokenizer, [f"{reward_file}:odd"], num_generations=6, pairs=True)
    assert pairs and all(set(p) == {"prompt", "chosen", "rejected", "chosen_label", "rejected_label", "answer"}
                         for p in pairs)
    for pair in pairs:
        group = [r for r in labelled if r["prompt"] == pair["prompt"]]
        assert sum(map(ord, pair["chosen"])) % 2 == 1 and sum(map(ord, pair["rejected"])) % 2 == 0
        assert pair["chosen_label"] == 1.0 and pair["rejected_label"] == 0.0
        completions = [r["completion"] for r in group]
        assert pair["chosen"] in completions and pair["rejected"] in completions
    for row in ROWS:  # each completion in one pair at most: at most G / 2 pairs per group
        group = [r for r in labelled if r["prompt"] == row["prompt"]]
        made = [p for p in pairs if p["prompt"] == row["prompt"]]
        good = sum(r["label"] for r in group)
        assert len(made) <= min(good, len(group) - good)
    assert counts["groups_without_pairs"] == sum(not any(p["prompt"] == row["prompt"] for p in pairs) for row in ROWS)


def test_sample_then_reward_train_then_grpo_through_the_cli(tmp_path, tiny_model_dir, reward_file, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    samples = tmp_path / "samples.jsonl"
    assert main(["sample", str(tiny_model_dir), "--dataset", str(data), "--num_generations", "4", "--output",
                 str(samples), "--reward_funcs", f"{reward_file}:has_a", "format", "--max_completion_length", "12",
                 "--temperature", "1.0", "--seed", "3", "--progress_bar", "false"]) == 0
    assert "wrote 16 labelled rows" in capsys.readouterr().out
    written = [json.loads(line) for line in samples.read_text().splitlines()]
    assert all(r["label"] == float("a" in r["completion"]) for r in written)

    config = tmp_path / "reward.yaml"
    config.write_text(yaml.safe_dump(dict(model=str(tiny_model_dir), dataset=str(samples),
                                          output_dir=str(tmp_path / "rm"),
                                          max_steps=2, batch_size=8, micro_batch_size=4, learning_rate=1e-3,
                                          eval_fraction=0.25, progress_bar=False)))
    assert main(["reward", "train", str(config)]) == 0
    out = capsys.readouterr().out
    assert "reward model (outcome, labelled rows, bce): 12 training rows, 4 held out; 2 steps" in out
    model = tmp_path / "rm" / "model"
    assert OutcomeRewardModel(model).__name__ == "model"

    grpo = tmp_path / "grpo.yaml"
    grpo.write_text(yaml.safe_dump(dict(model=str(tiny_model_dir), dataset=str(data), output_dir=str(tmp_path / "grpo"),
                                        reward_funcs=[f"model:{model}"], prompts_per_step=2, num_generations=2,
                                        max_completion_length=8, max_steps=1, progress_bar=False)))
    assert main(["train", str(grpo)]) == 0
    (metrics,) = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/model" in metrics


def test_step_rows_and_pairs_through_the_cli_train_reward_models(tmp_path, tiny_model_dir, reward_file, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    for name, options in [("steps", ["--reward_funcs", f"{reward_file}:line_steps"]),
                          ("pairs", ["--reward_funcs", f"{reward_file}:odd", "--pairs"])]:
        out = tmp_path / f"{name}.jsonl"
        assert main(["sample", str(tiny_model_dir), "--dataset", str(data), "--num_generations", "6", "--output",
                     str(out), "--max_completion_length", "16", "--progress_bar", "false", *options]) == 0
        assert f"{'pairs' if name == 'pairs' else 'step rows'} to {out}" in capsys.readouterr().out
        assert main(["reward", "train", "--model", str(tiny_model_dir), "--dataset", str(out), "--output_dir",
                     str(tmp_path / name), "--max_steps", "1", "--eval_fraction", "0", "--progress_bar", "false"]) == 0
        assert f"{name} rows" in capsys.readouterr().out
    ProcessRewardModel(tmp_path / "steps" / "model")
    OutcomeRewardModel(tmp_path / "pairs" / "model")


def test_bad_sample_arguments_are_one_clear_line(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"question": "What is 1 + 1?"}) + "\n")
    out = str(tmp_path / "out.jsonl")
    assert main(["sample", str(tiny_model_dir), "--dataset", str(data), "--num_generations", "2", "--output", out]) == 2
    assert "line 1 has no column 'prompt'" in capsys.readouterr().err
    assert main(["sample", str(tiny_model_dir), "--dataset", str(data), "--prompt_column", "question",
                 "--num_generations", "2", "--output", out, "--reward_funcs", "acuracy"]) == 2
    assert "unknown reward 'acuracy'; did you mean 'accuracy'?" in capsys.readouterr().err
    assert main(["sample", str(tiny_model_dir), "--dataset", str(data), "--prompt_column", "question",
                 "--num_generations", "1", "--pairs", "--output", out, "--progress_bar", "false"]) == 2
    assert "num_generations must be at least 2" in capsys.readouterr().err

ENVIRONMENT = '''
class Notes:
    def reset(self, answer, **row):
        self.answer = answer

    def note(self, text: str) -> str:
        """Keep a note.

        Args:
            text: the note
        """
        return "noted"

    def get_reward(self):
        return 0.5


def knows_answer(completions, environments, **kwargs):
    return [float(len(e.answer)) for e in environments]
'''


def test_sampling_with_tools_through_the_cli(tmp_path, capsys):
    """--tools and --environment-factory: the model calls them as in a run with those tools; a label may read
    each completion's environment, as a run's reward functions do."""
    from grpokit.tasks.tiny_model import build_model, build_tokenizer
    from helpers import TOOL_SPEC as SPEC

    model_dir, tokenizer = tmp_path / "model", build_tokenizer(tool_tags=True)
    build_model(tokenizer, SPEC, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    out = tmp_path / "samples.jsonl"
    common = ["sample", str(model_dir), "--dataset", str(data), "--num_generations", "4", "--output", str(out),
              "--max_completion_length", "40", "--progress_bar", "false", "--tools", "calculator"]
    assert main([*common, "--environment_factory", f"{tmp_path}/env.py:Notes",
                 "--reward_funcs", f"{tmp_path}/env.py:knows_answer"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 16 and any(r["tool_calls"] for r in rows)
    # The environment's own reward labels too, as it rewards a run: named after its class, weight 1.
    assert all(r["rewards"]["Notes"] == 0.5 for r in rows)
    assert [r["label"] for r in rows] == [float(len(row["answer"])) + 0.5 for row in ROWS for _ in range(4)]
    capsys.readouterr()
    assert main([*common[:-1], "calculater"]) == 2
    assert "tools: unknown tool 'calculater'" in capsys.readouterr().err


def test_prompts_are_rendered_with_the_chat_template_unless_told_not_to(tmp_path, monkeypatch):
    import grpokit.training.labelling
    from grpokit.tasks.tiny_model import build_model, build_tokenizer
    from helpers import CHAT_TEMPLATE as TEMPLATE

    model_dir, tokenizer = tmp_path / "model", build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    build_model(tokenizer, TINY, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS[:2]))
    rendered, real = [], grpokit.training.labelling.render_prompt
    monkeypatch.setattr(grpokit.training.labelling, "render_prompt",
                        lambda *a, **k: rendered.append(real(*a, **k)) or rendered[-1])
    command = ["sample", str(model_dir), "--dataset", str(data), "--num_generations", "2", "--output",
               str(tmp_path / "out.jsonl"), "--max_completion_length", "4", "--progress_bar", "false"]
    assert main(command) == 0 and main([*command, "--chat_template", "false"]) == 0
    templated = [f"[user] {row['prompt']}\n[assistant] " for row in ROWS[:2]]
    assert rendered == templated + [row["prompt"] for row in ROWS[:2]]


def labelled(label, completion="c", **extra):
    return {"prompt": "p", "completion": completion, "label": label, **extra}


@pytest.mark.parametrize("labels, pairs", [
    ([3, -1, 2, 0], [(3, -1), (2, 0)]),  # best with worst, second best with second worst
    ([-1, -3, -2], [(-1, -3)]),  # an odd group: the middle completion in no pair; negative labels alike
    ([0.5, 0.5, 0.5, 0.5], []), ([1, 1, 0, 0], [(1, 0), (1, 0)]), ([2, 1, 1, 1], [(2, 1)]), ([7], []), ([], []),
    ([-0.0, 0.0], []), ([1e-9, 0], [(1e-9, 0)]),
])
def test_pairs_join_the_best_with_the_worst_and_skip_ties(labels, pairs):
    from grpokit.training.labelling import _pairs

    counts = {"empty_sides": 0}
    group = [labelled(v, completion=f"c{i}") for i, v in enumerate(labels)]
    made = _pairs(group, counts)
    assert [(p["chosen_label"], p["rejected_label"]) for p in made] == pairs and counts["empty_sides"] == 0
    for pair in made:
        chosen, rejected = (next(r for r in group if r["completion"] == pair[side]) for side in ("chosen", "rejected"))
        assert (chosen["label"], rejected["label"]) == (pair["chosen_label"], pair["rejected_label"])
        assert pair.keys() == {"prompt", "chosen", "rejected", "chosen_label", "rejected_label"}


def test_a_pair_with_an_empty_side_is_counted_not_made_and_the_answer_is_kept():
    from grpokit.training.labelling import _pairs

    counts = {"empty_sides": 0}
    made = _pairs([labelled(2, " \n"), labelled(1, "b", answer="4"), labelled(3, "a", answer="4"),
                   labelled(0, "d", answer="4")], counts)
    assert counts["empty_sides"] == 1
    assert made == [{"prompt": "p", "chosen": "a", "rejected": "d", "chosen_label": 3, "rejected_label": 0,
                     "answer": "4"}]


def test_an_empty_side_skips_its_pair_only_and_every_one_is_counted():
    from grpokit.training.labelling import _pairs

    counts = {"empty_sides": 5}  # the counts so far, over earlier groups
    made = _pairs([labelled(3, ""), labelled(2, "a"), labelled(1, "b"), labelled(0, " ")], counts)
    assert [(p["chosen"], p["rejected"]) for p in made] == [("a", "b")] and counts["empty_sides"] == 6
    made = _pairs([labelled(9, " "), labelled(8, "x"), labelled(7, "\t"), labelled(1, "y"), labelled(0, "z"),
                   labelled(-1, "w")], counts)
    assert [(p["chosen"], p["rejected"]) for p in made] == [("x", "z")] and counts["empty_sides"] == 8
