"""pass@k: the unbiased estimator against enumerating every subset of k samples; programming problems judged by
their tests."""

import itertools
import json
import random

import pytest

import grpokit.rollout.engines
from grpokit.cli.main import main
from grpokit.sandbox import Limits
from grpokit.training.evaluation import pass_at_k
from helpers import sandbox_or_skip


def test_pass_at_k_matches_enumeration():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        c, k = rng.randint(0, n), rng.randint(1, n)
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


@pytest.mark.parametrize("n, c, k", [(4, 1, 0), (4, 1, 5)])
def test_pass_at_k_needs_k_within_the_samples(n, c, k):
    with pytest.raises(ValueError, match=r"pass@k needs 1 <= k <= n"):
        pass_at_k(n, c, k)


def test_eval_judges_programming_problems_by_their_tests(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Rows with a `tests` column: correct when the completion's program passes every test (in the sandbox), formatted
    when it holds a program; the completions file carries the tests in place of an answer."""
    sandbox_or_skip("bwrap", Limits())
    tests = ["assert double(2) == 4", "assert double(5) == 10"]
    rows = [{"prompt": f"Write double(x), case {i}", "tests": tests} for i in range(3)]
    scripted = ["```python\ndef double(x):\n    return 2 * x\n```",  # passes both
                "```python\ndef double(x):\n    return x + 2\n```",  # passes one: not correct
                "Double x by multiplying it by two."]  # no program
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))

    class Scripted:
        def __init__(self, texts):
            self.texts = texts

        def decode(self, tokenizer):
            return self.texts

    monkeypatch.setattr(grpokit.rollout.engines, "generate",
                        lambda model, input_ids, *args, **kwargs: Scripted(scripted[:len(input_ids)]))
    out, completions = tmp_path / "eval.json", tmp_path / "completions.jsonl"
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data), "--num_generations", "0", "--progress_bar",
                 "false", "--output", str(out), "--completions", str(completions)]) == 0
    summary = json.loads(out.read_text())
    assert summary["greedy_correct"] == pytest.approx(1 / 3) and summary["greedy_format"] == pytest.approx(2 / 3)
    written = [json.loads(line) for line in completions.read_text().splitlines()]
    assert [(w["correct"], w["format"]) for w in written] == [(1, 1), (0, 1), (0, 0)]
    assert all(w["tests"] == tests and "answer" not in w for w in written)
