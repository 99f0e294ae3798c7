"""reasoning-gym tasks (``dataset: reasoning_gym:TASK``): rows generated from a seed, held-out rows from another,
mixes, the task's own scorer as the reward (in the sandbox), what a run logs of it, and the errors that name what is
wrong."""

import json

import pytest
import torch

pytest.importorskip("reasoning_gym")
import reasoning_gym  # noqa: E402

from grpokit import GRPOConfig, GRPOTrainer  # noqa: E402
from grpokit.cli.main import main  # noqa: E402
from grpokit.core.answers import ANSWER_EXTRACTIONS, extract_by  # noqa: E402
from grpokit.data import DataError  # noqa: E402
from grpokit.rollout.generate import Rollout  # noqa: E402
from grpokit.tasks import reasoning_gym as rg  # noqa: E402
from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer  # noqa: E402
from helpers import approx_scores  # noqa: E402

SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=160)


def own_scores(task: str, rows, completions, extraction="tag", **settings):
    """What reasoning-gym itself gives each completion: its dataset's score_answer on the extracted answer."""
    dataset = reasoning_gym.create_dataset(task, size=1, seed=0, **settings)
    return [dataset.score_answer(extract_by(c, extraction), {"question": r["prompt"], "answer": r["answer"],
                                                             "metadata": r["metadata"]})
            for r, c in zip(rows, completions)]


def test_rows_are_the_tasks_generated_from_the_seed():
    rows = rg.train_rows("reasoning_gym:chain_sum", {"size": 12, "config": {"min_terms": 2, "max_terms": 2}}, 3)
    entries = list(reasoning_gym.create_dataset("chain_sum", size=12, seed=3, min_terms=2, max_terms=2))
    assert [(r["prompt"], r["answer"], r["task"]) for r in rows] == [
        (e["question"], e["answer"], "chain_sum") for e in entries]
    assert all(r["metadata"]["num_terms"] == 2 for r in rows)
    assert json.loads(json.dumps(rows)) == rows  # a file gives them back as they are
    assert rg.train_rows("reasoning_gym:chain_sum", {"size": 12, "seed": 3}, 0) != rg.train_rows(
        "reasoning_gym:chain_sum", {"size": 12, "seed": 4}, 0)


def test_held_out_rows_come_from_another_seed_without_the_training_questions():
    options = {"size": 40, "eval_size": 50, "config": {"min_digits": 1, "max_digits": 1, "max_terms": 2}}
    train = {r["prompt"] for r in rg.train_rows("reasoning_gym:chain_sum", options, 0)}
    held = rg.held_out_rows("reasoning_gym:chain_sum", options, 0)
    drawn = {r["prompt"] for r in rg.generate("reasoning_gym:chain_sum", 116, 40, options["config"])}
    assert drawn & train  # 200 one-digit sums: other seeds repeat some training questions...
    assert len({r["prompt"] for r in held}) == 50 and not train & {r["prompt"] for r in held}  # ...dropped
    # row i is drawn from seed + i: eval_seed 1 would draw the training rows again, shifted by one
    shifted = [(r["prompt"], r["answer"]) for r in rg.generate("reasoning_gym:gcd", 5, 1)]
    assert shifted[:4] == [(r["prompt"], r["answer"]) for r in rg.generate("reasoning_gym:gcd", 5, 0)][1:]
    with pytest.warns(UserWarning, match=r"17 held-out rows, not eval_size 50: .*eval_seed in \[-115, 99\] repeats"):
        # 116 rows drawn from seeds 1 to 116, of which 100 to 116 are not the training rows'
        assert len(rg.held_out_rows("reasoning_gym:gcd", {"size": 100, "eval_size": 50, "eval_seed": 1}, 0)) == 17
    with pytest.raises(DataError, match="every held-out question is among the training rows"):
        rg.held_out_rows("reasoning_gym:gcd", {"size": 200, "eval_size": 10, "eval_seed": 10}, 0)


def test_a_mix_draws_from_each_task_by_its_weight_with_its_settings():
    rows = rg.train_rows("reasoning_gym:chain_sum,spell_backward",
                         {"size": 300, "weights": {"chain_sum": 3}, "config": {"chain_sum": {"max_terms": 2}}}, 0)
    tasks = [r["task"] for r in rows]
    assert set(tasks) == {"chain_sum", "spell_backward"} and 180 < tasks.count("chain_sum") < 270  # 3 : 1
    assert all(r["metadata"]["num_terms"] <= 2 for r in rows if r["task"] == "chain_sum")


@pytest.mark.parametrize("spec, options, match", [
    ("reasoning_gym:chain_sun", {}, r"reasoning-gym has no task 'chain_sun'; did you mean 'chain_sum'"),
    ("reasoning_gym:composite", {}, "reasoning-gym has no task 'composite'"),
    ("reasoning_gym:chain_sum,chain_sum", {}, "a task is named twice"),
    ("reasoning_gym:chain_sum", {"sise": 10}, "unknown option 'sise'; did you mean 'size'"),
    ("reasoning_gym:chain_sum", {"size": 0}, "size must be a positive integer"),
    ("reasoning_gym:chain_sum", {"config": {"min_termz": 2}}, r"refused the settings .*min_termz"),
    ("reasoning_gym:chain_sum,gcd", {"config": {"lcm": {}}}, "'lcm' is not one of the mix's tasks"),
    ("reasoning_gym:chain_sum,gcd", {"weights": {"lcm": 2}}, "weights names 'lcm'"),
])
def test_bad_tasks_and_options_are_named(spec, options, match):
    with pytest.raises(DataError, match=match):
        rg.train_rows(spec, options, 0)


# Right, right with more after it (partial credit), untagged, tagged twice, empty: what a model may write.
KINDS = [lambda a: f"<think>ok</think><answer>{a}</answer>", lambda a: f"<answer>{a}{a[:3]}</answer>",
         lambda a: a, lambda a: f"<answer>{a}</answer><answer>{a}</answer>", lambda a: "<answer></answer>"]


def completions_for(rows):
    """One of KINDS per row, in turn."""
    return [KINDS[i % len(KINDS)](r["answer"]) for i, r in enumerate(rows)]


def test_the_reward_is_the_tasks_own_score_partial_credit_included(any_isolation):
    rows = rg.train_rows("reasoning_gym:spell_backward", {"size": 10}, 0)
    completions = completions_for(rows)
    score = rg.TaskScore(isolation=any_isolation)
    got = score(prompts=[r["prompt"] for r in rows], completions=completions, answer=[r["answer"] for r in rows],
                metadata=[r["metadata"] for r in rows])
    expected = own_scores("spell_backward", rows, completions)
    assert got == expected and 0 < min(s for s in got if s) < 1 and max(got) == 1.0 and score.errors == 0


@pytest.mark.parametrize("extraction", ANSWER_EXTRACTIONS)
def test_each_extraction_reads_the_answer_the_task_scores(extraction, any_isolation):
    rows = rg.train_rows("reasoning_gym:chain_sum", {"size": 3}, 0)
    completions = [f"So it is\n{r['answer']}" if extraction != "boxed" else f"\\boxed{{{r['answer']}}}" for r in rows]
    completions[0] = f"<answer>{rows[0]['answer']}</answer>"
    got = rg.TaskScore(extraction, isolation=any_isolation)(
        prompts=[r["prompt"] for r in rows], completions=completions, answer=[r["answer"] for r in rows],
        metadata=[r["metadata"] for r in rows])
    assert got == own_scores("chain_sum", rows, completions, extraction)


def test_a_scorer_that_evals_the_answer_runs_it_in_the_sandbox_not_here(any_isolation, tmp_path):
    """spiral_matrix's scorer evals any answer that is not the oracle's: the model's text runs, in the sandbox."""
    rows = rg.train_rows("reasoning_gym:spiral_matrix", {"size": 2}, 0)
    target = tmp_path / "pwned"
    hostile = f"<answer>__import__('pathlib').Path({str(target)!r}).write_text('x') or [1]</answer>"
    as_list = "<answer>[" + ", ".join(rows[1]["answer"].split()) + "]</answer>"  # eval'd: partial credit, 0.1
    score = rg.TaskScore(isolation=any_isolation)
    got = score(prompts=[r["prompt"] for r in rows], completions=[hostile, as_list],
                answer=[r["answer"] for r in rows], metadata=[r["metadata"] for r in rows])
    assert got == [0.0, 0.1] and not target.exists()


def test_a_scorer_sandbox_that_cannot_import_reasoning_gym_is_named_not_the_answers(any_isolation, monkeypatch):
    """The sandbox's interpreter without reasoning-gym (as a venv's base interpreter lacked it): the error is the
    sandbox's and says where to install it, never a reward's return value."""
    from grpokit.sandbox import Sandbox

    rows = rg.train_rows("reasoning_gym:chain_sum", {"size": 1}, 0)
    score = rg.TaskScore(isolation=any_isolation)
    monkeypatch.setattr(score, "start_sandbox", lambda answers=1: Sandbox(any_isolation, site_packages=False))
    with pytest.raises(RuntimeError, match=rf"(?s)reasoning_gym: the scorer's sandbox \({any_isolation} isolation\) "
                       r"failed before scoring any answer, so no answer is at fault: exit 1: .*No module named "
                       r"'reasoning_gym'\. The sandbox runs .*python.* install reasoning-gym there"):
        score(prompts=[rows[0]["prompt"]], completions=["<answer>1</answer>"], answer=[rows[0]["answer"]],
              metadata=[rows[0]["metadata"]])


def test_rows_without_a_task_are_refused_by_name():
    with pytest.raises(ValueError, match="reasoning_gym: the metadata of completion 0's row names no task"):
        rg.TaskScore()(prompts=["q"], completions=["a"], answer=["a"], metadata=[{}])
    with pytest.raises(ValueError, match="answer_extraction='xml' is not one of 'tag'"):
        rg.TaskScore("xml")


def scripted_generate(tokenizer, answers):
    """A stand-in for the sampler: a group's completions are KINDS of its prompt's answer, in turn (greedy, a group of
    one: the right answer)."""

    def generate(model, prompt_ids, prompt_mask, *, num_generations, max_new_tokens, eos_token_id, pad_token_id,
                 **kw):
        texts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(prompt_ids, prompt_mask)]
        completions = [KINDS[g % len(KINDS)](answers[text]) for text in texts for g in range(num_generations)]
        ids = torch.full((len(completions), max_new_tokens), pad_token_id)
        lengths = []
        for i, text in enumerate(completions):
            encoded = tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens - 1] + [eos_token_id[0]]
            ids[i, :len(encoded)] = torch.tensor(encoded)
            lengths.append(len(encoded))
        mask = (torch.arange(max_new_tokens) < torch.tensor(lengths).unsqueeze(1)).long()
        repeat = lambda t: t.repeat_interleave(num_generations, 0)  # noqa: E731
        return Rollout(repeat(prompt_ids), repeat(prompt_mask), ids, mask, torch.zeros(ids.shape),
                       torch.zeros(len(completions), dtype=torch.bool), None)

    return generate


def test_a_run_logs_the_tasks_own_score_of_each_completion(monkeypatch, tmp_path, any_isolation):
    """By default a reasoning_gym: dataset is rewarded by its scorer alone; the reward logged for each completion is
    reasoning-gym's score_answer of its answer, and held-out evaluation judges by it too (eval_score)."""
    import grpokit.rollout.engines

    tokenizer = build_tokenizer()
    options = {"size": 16, "eval_size": 4, "config": {"min_word_len": 3, "max_word_len": 5}}
    rows = rg.train_rows("reasoning_gym:spell_backward", options, 0)
    held = rg.held_out_rows("reasoning_gym:spell_backward", options, 0)
    answers = {r["prompt"]: r["answer"] for r in rows + held}
    monkeypatch.setattr(grpokit.rollout.engines, "generate", scripted_generate(tokenizer, answers))
    config = GRPOConfig(dataset="reasoning_gym:spell_backward", reasoning_gym=options, output_dir=str(tmp_path / "run"),
                        eval_dataset="reasoning_gym:spell_backward", eval_samples=0, sandbox=any_isolation,
                        prompts_per_step=2, num_generations=5, max_completion_length=24, max_steps=2,
                        progress_bar=False, mixed_precision="no")
    trainer = GRPOTrainer(config, model=build_model(tokenizer, SPEC, seed=0), tokenizer=tokenizer)
    assert [fn.__name__ for fn in trainer.reward_funcs] == ["reasoning_gym"]
    history = trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    by_prompt = {r["prompt"]: r for r in rows}
    expected = own_scores("spell_backward", [by_prompt[r["prompt"]] for r in records],
                          [r["completion"] for r in records], min_word_len=3, max_word_len=5)
    # logged through float32 tensors: equal to reasoning-gym's to float32's precision
    assert [r["reasoning_gym"] for r in records] == approx_scores(expected) == [r["reward"] for r in records]
    assert {0.0, 1.0} < set(expected) and any(0 < s < 1 for s in expected)  # full, partial and no credit
    evaluated = [m for m in history if "eval_score" in m]
    assert [m["step"] for m in evaluated] == [0, 2]
    # greedy completions are completions_for's first kind, the right answer: solved, full score
    assert all(m["eval_accuracy"] == 1.0 and m["eval_score"] == 1.0 for m in evaluated)


def test_the_command_line_trains_and_evaluates_a_task(tmp_path, any_isolation):
    """`grpokit train` and `grpokit eval` on a reasoning-gym task: the scorer by default, eval's score in the
    summary, every greedy completion's score in its file."""
    tokenizer, model_dir = build_tokenizer(), tmp_path / "model"
    build_model(tokenizer, SPEC, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config = tmp_path / "rg.yaml"
    config.write_text(f"model: {model_dir}\ndataset: reasoning_gym:chain_sum\nsandbox: {any_isolation}\n"
                      "reasoning_gym: {size: 8, eval_size: 3, config: {min_terms: 2, max_terms: 2, max_digits: 1}}\n"
                      "prompts_per_step: 2\nnum_generations: 2\nmax_completion_length: 8\nprogress_bar: false\n")
    assert main(["train", str(config), "--max_steps", "1", "--output_dir", str(tmp_path / "run")]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/reasoning_gym" in metrics[0] and "rewards/accuracy" not in metrics[0]
    out, completions = tmp_path / "eval.json", tmp_path / "eval.jsonl"
    assert main(["eval", str(config), "--num_generations", "2",
                 "--output", str(out), "--completions", str(completions)]) == 0
    summary = json.loads(out.read_text())
    assert summary["num_prompts"] == 3 and {"greedy_score", "sampled_score", "greedy_correct"} <= set(summary)
    assert "greedy_lenient" not in summary
    rows = [json.loads(line) for line in completions.read_text().splitlines()]
    held = rg.held_out_rows("reasoning_gym:chain_sum", {"size": 8, "eval_size": 3, "config": {
        "min_terms": 2, "max_terms": 2, "max_digits": 1}}, 0)
    assert [r["score"] for r in rows] == own_scores("chain_sum", held, [r["completion"] for r in rows])
