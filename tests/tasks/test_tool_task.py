"""The built-in tools task: deterministic for a seed, held-out problems never trained on, and a corpus whose
hand products are systematically wrong while its calculator calls are right."""

import json
import random

from grpokit.rewards.builtin import accuracy_reward, format_reward
from grpokit.rollout.tools import calculator, parse_tool_call
from grpokit.tasks import tool_task
from grpokit.tasks.tiny_model import build_tokenizer
from grpokit.tasks.warm_start import supervised_batch


def pair(prompt):
    a, b = prompt.removeprefix("What is ").removesuffix("?").split(" * ")
    return int(a), int(b)


def test_rows_are_deterministic_for_a_seed_and_held_out_rows_are_never_trained_on():
    assert tool_task.train_rows(50, seed=3) == tool_task.train_rows(50, seed=3)
    assert tool_task.train_rows(50, seed=3) != tool_task.train_rows(50, seed=4)
    assert tool_task.held_out_rows(100) == tool_task.held_out_rows(100)
    held_out = {pair(r["prompt"]) for r in tool_task.held_out_rows(400)}
    assert len(held_out) == 400
    trained = {pair(r["prompt"]) for r in tool_task.train_rows(4096, seed=0)}
    corpus = {pair(tool_task.corpus_example(random.Random(0))[0]) for _ in range(2000)}
    assert not held_out & trained and not held_out & corpus
    assert all(100 <= a <= 999 and 10 <= b <= 99 and str(a * b) == r["answer"]
               for r in tool_task.held_out_rows(400) for a, b in [pair(r["prompt"])])


def test_the_corpus_is_deterministic_and_a_minority_calls_the_tool():
    first = [tool_task.corpus_example(random.Random(5)) for _ in range(3)]
    assert first == [tool_task.corpus_example(random.Random(5)) for _ in range(3)]
    rng = random.Random(0)
    examples = [tool_task.corpus_example(rng) for _ in range(4000)]
    share = sum(len(pieces) == 3 for _, pieces in examples) / len(examples)
    assert abs(share - tool_task.TOOL_SHARE) < 0.03


def test_tool_solutions_are_right_and_hand_solutions_systematically_wrong():
    rng = random.Random(1)
    right = {True: [], False: []}
    for _ in range(500):
        prompt, pieces = tool_task.corpus_example(rng)
        text = "".join(t for t, _ in pieces)
        answer = str(eval_product(prompt))
        used_tool = len(pieces) == 3
        right[used_tool].append(accuracy_reward([prompt], [text], answer=[answer])[0])
        assert format_reward([prompt], [text]) == [1.0]
        if used_tool:
            call = parse_tool_call(pieces[0][0].removeprefix("<think>\n"))
            assert call.name == "calculator" and calculator(**call.arguments) == answer
            assert pieces[1] == (f"<result>{answer}</result>", False)  # context, not the model's to write
    assert sum(right[True]) == len(right[True])
    assert sum(right[False]) / len(right[False]) < 0.05


def eval_product(prompt):
    a, b = pair(prompt)
    return a * b


def test_the_warm_start_loss_skips_the_results():
    tokenizer = build_tokenizer(tool_tags=True)
    prompt, pieces = "What is 347 * 58?", tool_task.worked_solution(347, 58, use_tool=True)
    batch = supervised_batch(tokenizer, [(prompt, pieces)])
    labelled = [i for i in batch["labels"][0].tolist() if i != -100]
    expected = tokenizer(pieces[0][0] + pieces[2][0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert labelled == expected
    assert json.dumps({"name": "calculator", "arguments": {"expression": "347*58"}}) in pieces[0][0]
