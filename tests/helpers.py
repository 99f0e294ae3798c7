"""Builders and constants that test modules in several folders share: the tiny models and their rows, a trainer
with the suite's defaults, its loss and gradient on a fixed batch, reward functions, and the documented metrics.

Test modules import them with ``from helpers import ...``: ``tests/`` is on ``sys.path`` (pyproject's
``pythonpath``; scripts that tests run in subprocesses insert it themselves). Fixtures live in ``conftest.py``;
no test module imports another."""

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from transformers import (
    LlamaConfig,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from grpokit import GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer
from grpokit.rollout.generate import Rollout, generate
from grpokit.rollout.tools import ToolSession
from grpokit.runtime.processes import kill_tree, run_or_kill  # noqa: F401 (kill_tree: the tests' launches)
from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer
from grpokit.training.update import NonfiniteGuard, UpdateBatch, update

TINY = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=64)

# ---- the trainer on the tiny model ---------------------------------------------------------------


def ones(prompts, completions, **kw):
    """Share of the completion's characters that are '1': easy to learn, smooth to score."""
    return [c.count("1") / max(1, len(c)) for c in completions]


def each_one(prompts, completions, **kw):
    """A step after every character: reward 1 for a '1', else 0."""
    return [[(k + 1, float(ch == "1")) for k, ch in enumerate(c)] for c in completions]


def approx_scores(expected, rel: float = 1e-6, abs: float = 1e-12):
    """``expected`` for an ``==`` that takes numbers within tolerance and ``None`` ("not applicable", a reward
    function's or a metric's) only as ``None``, in lists, tuples and dicts at any depth. ``pytest.approx`` alone
    refuses a ``None`` inside a sequence since pytest 9.2 (a TypeError, not a failed comparison)."""
    if expected is None or isinstance(expected, (str, bool)):
        return expected
    if isinstance(expected, dict):
        return {key: approx_scores(value, rel, abs) for key, value in expected.items()}
    if isinstance(expected, (list, tuple)):
        return type(expected)(approx_scores(value, rel, abs) for value in expected)
    return pytest.approx(expected, rel=rel, abs=abs)


METRICS_DOC = Path(__file__).parent.parent / "docs" / "metrics.md"
ROWS = [{"prompt": f"Count {i}:", "answer": "1"} for i in range(32)]


def documented_metrics(reward_models: bool = False, code_rewards: bool = False,
                       lowered: bool = False, agents: bool = False) -> tuple[set[str], set[str]]:
    """The keys in docs/metrics.md's tables: every run's (with ``reward_models``: and those reward models add; with
    ``code_rewards``: those code_tests adds; with ``lowered``: those a bfloat16 sampler adds; with ``agents``: those an
    agent adds), and the ones PPO adds."""
    common, *sections = re.split(r"^## ", METRICS_DOC.read_text(), flags=re.M)
    section = lambda title: next(s for s in sections if s.startswith(title))  # noqa: E731
    keys = lambda text: set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))  # noqa: E731
    added = [title for title, wanted in (("Reward models add", reward_models), ("Code rewards add", code_rewards),
                                         ("Sampling in a lower precision adds", lowered),
                                         ("Agents add", agents)) if wanted]
    return keys(common).union(*(keys(section(title)) for title in added)), keys(section("PPO adds"))


def logged_keys(metrics: dict) -> set[str]:
    return {re.sub(r"^(rewards|reward_truncated)/.*", r"\1/<name>", key) for key in metrics}


def make_trainer(tokenizer, model, tmp_path, rows=ROWS, reward_funcs=(ones,), **overrides):
    values = dict(output_dir=str(tmp_path / "run"), prompts_per_step=4, num_generations=8, max_completion_length=8,
                  learning_rate=1e-2, max_steps=20, micro_batch_size=12, progress_bar=False, lr_schedule="constant",
                  mixed_precision="no")  # float32 on any machine: tests compare values at float32's precision
    values.update(overrides)
    return GRPOTrainer(GRPOConfig(**values), model=model, tokenizer=tokenizer, train_dataset=rows,
                       reward_funcs=list(reward_funcs))


def loss_and_gradient(trainer, batch: UpdateBatch, learner=None) -> tuple[dict[str, float], torch.Tensor]:
    """The trainer's update of ``learner`` (default: the policy) on ``batch``, with an optimizer that moves
    nothing: the update's diagnostics and the gradient it accumulated (before clipping), over every parameter."""
    learner = learner or trainer.policy
    params = list(learner.module.parameters())
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: grads.__setitem__(i, p.grad.clone()))
             for i, p in enumerate(params)]
    optimizer = torch.optim.SGD(params, lr=0.0)
    still = dataclasses.replace(learner, optimizer=optimizer,
                                scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    (stats,) = update([still], batch, micro_batch_size=trainer.config.micro_batch_size, max_grad_norm=0,
                      guard=NonfiniteGuard(1))
    for hook in hooks:
        hook.remove()
    return stats, torch.cat([grads.get(i, torch.zeros_like(p)).flatten() for i, p in enumerate(params)])


def fixed_rollout(trainer, tokenizer, max_new_tokens=8) -> Rollout:
    prompt_ids, prompt_mask = trainer.sampler.tokenize_prompts([row["prompt"] for row in ROWS[:4]])
    return generate(trainer.model, prompt_ids, prompt_mask, num_generations=8, max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    generator=torch.Generator().manual_seed(0))


# ---- models of the Llama family and a fixed batch for them ---------------------------------------

FAMILY_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=None)


def models(tokenizer) -> dict[str, torch.nn.Module]:
    """The built-in Llama; Qwen2 with q/k/v biases and grouped queries (2 key/value heads for 4); Mistral."""
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**FAMILY_SHAPE, **ids, num_key_value_heads=2))
    with torch.no_grad():  # random, not zero, biases
        for layer in qwen2.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    mistral = MistralForCausalLM(MistralConfig(**FAMILY_SHAPE, **ids, num_key_value_heads=4, sliding_window=None))
    return {"llama": build_model(tokenizer, TINY, seed=0), "qwen2-gqa-bias": qwen2, "mistral": mistral}


def fixed_batch(tokenizer):
    """Left-padded prompts of different lengths, each twice (as a group shares its prompt, which the fast
    path then computes once); completions that stop at different places, with garbage (not padding)
    after their EOS, which the mask must make irrelevant."""
    enc = tokenizer(["What is 1 + 2?", "Hi", "What is 47 + 85? Think.", "7"], padding=True, padding_side="left",
                    return_tensors="pt")
    prompt_ids, prompt_mask = (t.repeat_interleave(2, dim=0) for t in (enc["input_ids"], enc["attention_mask"]))
    gen = torch.Generator().manual_seed(1)
    completions = torch.randint(3, 90, (8, 9), generator=gen)
    lengths = torch.tensor([9, 3, 1, 6, 5, 5, 7, 2])
    completions[torch.arange(8), lengths - 1] = tokenizer.eos_token_id
    completions[0, -1] = 50  # truncated: no EOS
    mask = (torch.arange(9) < lengths.unsqueeze(1)).long()
    return prompt_ids, prompt_mask, completions, mask


def brute_force_ends(tokenizer, ids, text, offsets):
    """For each offset, the first token whose decoded prefix reaches it; the end of the text → last token."""
    lengths = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    return [len(ids) - 1 if c == len(text) else next(k for k, n in enumerate(lengths) if n >= c) for c in offsets]


# ---- reward-model training (tests/algorithms/test_reward_train.py, test_reward_trainer_inputs.py) -------------


def _word(rng, marker):
    letters = [rng.choice("abcdefgh") for _ in range(rng.randint(1, 3))]
    if marker:
        letters.insert(rng.randrange(len(letters) + 1), "!")
    return "".join(letters)


def reward_rows(form, n=80, seed=0):
    """Rows of each reward-model form (labelled, pairs, steps), separable: a completion (a step) is good when it
    contains the marker '!'."""
    rng = random.Random(seed)
    if form == "labelled":
        return [{"prompt": "q:", "completion": _word(rng, i % 2 == 0), "label": float(i % 2 == 0)} for i in range(n)]
    if form == "pairs":
        return [{"prompt": "q:", "chosen": _word(rng, True), "rejected": _word(rng, False)} for _ in range(n)]
    rows = []
    for _ in range(n):
        lines = [_word(rng, rng.random() < 0.5) for _ in range(3)]
        ends = [sum(len(line) + 1 for line in lines[:k]) + len(lines[k]) for k in range(3)]
        rows.append({"prompt": "q:", "completion": "\n".join(lines),
                     "steps": [[end, float("!" in line)] for end, line in zip(ends, lines)]})
    return rows


def reward_config(tmp_path, **overrides) -> RewardConfig:
    values = dict(model="unused", output_dir=str(tmp_path / "rm"), learning_rate=1e-2, lr_schedule="constant",
                  batch_size=16, micro_batch_size=16, max_steps=4, eval_fraction=0.2, progress_bar=False,
                  mixed_precision="no")  # exact comparisons: never bf16, whatever 'auto' finds here
    return RewardConfig(**{**values, **overrides})


def reward_trainer(tmp_path, tiny_model_dir, rows, **overrides) -> RewardTrainer:
    return RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir), **overrides), train_dataset=rows)


# ---- chat templates, reward models, tools --------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


def save_classifier(path, tokenizer, head="sequence", num_labels=1, max_positions=64, seed=0):
    """A randomly initialised 2-layer Llama classifier (large initial weights, so that texts score apart). Llama:
    transformers 5 loads the tokenizer of a Qwen2 directory as Qwen2's own, whatever was saved."""
    classes = {"sequence": LlamaForSequenceClassification, "token": LlamaForTokenClassification}
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                          num_labels=num_labels, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    classes[head](config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# A context long enough for tool results, and rows whose answers need the calculator.
TOOL_SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=320)
TOOL_ROWS = [{"prompt": f"What is {a} * 7?", "answer": str(a * 7)} for a in range(10, 30)]


class Scripted(ToolSession):
    """A session whose completions write the given texts (then EOS), whatever the model samples."""

    def __init__(self, box, texts, max_new_tokens):
        super().__init__(box, len(texts), max_new_tokens, None)
        self.script = [box.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        self.written = [0] * len(texts)

    def intervene(self, columns, rows, chosen, stopped, logp):
        chosen, stopped = chosen.clone(), stopped.clone()
        for k, row in enumerate(rows.tolist()):
            if row in self.pending or row in self.waiting or row in self.ending:
                continue  # the result goes in first
            script, at = self.script[row], self.written[row]
            chosen[k] = script[at] if at < len(script) else self.box.tokenizer.eos_token_id
            stopped[k] = at >= len(script)
            self.written[row] += 1
        return super().intervene(columns, rows, chosen, stopped, logp)


def write_config(tmp_path, tiny_model_dir, data_file, **extra):
    """A `grpokit train` YAML file: the tiny model on ``data_file`` (conftest's fixture of that name), 2 steps."""
    config = dict(model=str(tiny_model_dir), dataset=str(data_file), output_dir=str(tmp_path / "run"),
                  prompts_per_step=2, num_generations=4, max_completion_length=8, max_steps=2, progress_bar=False)
    config.update(extra)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ---- chat templates that know tools (tests/rollout/test_tool_templates.py, tests/cli/test_cli.py) ----

HERMES = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call functions. Their signatures, within <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each call, write a JSON object with its name and arguments within <tool_call></tool_call>:\n' }}
{{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
TEMPLATE_SPEC = TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=1536)


def tokenizer_with(template, specials=("<|im_start|>", "<|im_end|>")):
    tok = build_tokenizer(tool_tags=True)
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return tok


# ---- resuming (any trainer on the engine) ----


def assert_resume_is_bit_exact(make, steps_before: int, volatile=("time_step", "tokens_per_sec")):
    """One run trained whole, another stopped after ``steps_before`` steps, checkpointed and resumed by a new
    trainer: both end with the same weights and the same metrics (``volatile`` ones, times, aside).
    ``make(name, **options)`` builds a trainer writing to the output directory ``name``."""
    whole = make("whole")
    whole.train()
    first = make("parts")
    for _ in range(steps_before):
        first.training_step()
    first.save_checkpoint()
    second = make("parts", resume="latest")
    second.train()
    for (name, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    drop = lambda history: [{k: v for k, v in m.items() if k not in volatile} for m in history]  # noqa: E731
    assert drop(second.history) == drop(whole.history)


# ---- the sandbox ---------------------------------------------------------------------------------------------


# Set from pytest's --require-sandbox (conftest.py): where the sandbox is known to start (CI, the mutation audit), a
# sandbox that cannot start is a fault to report, not a machine to skip on.
REQUIRE_SANDBOX = False


def no_sandbox(reason: str):
    """Skip the test for ``reason`` (the sandbox cannot start here), or fail it under --require-sandbox."""
    import pytest

    if REQUIRE_SANDBOX:
        pytest.fail(f"{reason} (--require-sandbox: the sandbox must start here)")
    pytest.skip(reason)


def sandbox_python(isolation: str) -> str | None:
    """The interpreter the tests' sandboxes run programs with (None: this one). The process isolation as root runs
    each program as a uid of its own, which needs an interpreter that others can read: where this one is not
    (a pyenv under /root), the system's /usr/bin/python3."""
    import os
    import sys

    from grpokit.sandbox.interpreter import closed_to_others

    if isolation == "process" and os.geteuid() == 0 and closed_to_others(os.path.realpath(sys.executable)):
        if not os.path.exists("/usr/bin/python3"):
            no_sandbox("the process isolation as root needs an interpreter others can read; none here")
        return "/usr/bin/python3"
    return None


def sandbox_or_skip(isolation: str, limits, workers: int | None = None):
    """A Sandbox (run by :func:`sandbox_python`), or the test skipped with the reason it cannot start here."""
    from grpokit.sandbox import Sandbox, SandboxUnavailable

    try:
        return Sandbox(isolation, limits, workers=workers, python=sandbox_python(isolation))
    except SandboxUnavailable as error:
        no_sandbox(f"the {isolation} sandbox cannot start here: {error}")


# ---- launching processes: torchrun, and runs that never outlive their test -------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def torchrun(processes: int, *options: str, port: int | None = None) -> list[str]:
    """torchrun on a free port of its own (back-to-back launches on a fixed port can collide)."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={processes}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port or free_port()}", *options]


def run_group(command: list[str], env: dict[str, str], timeout: int = 600):
    """Run ``command``; past ``timeout`` it is killed with every process it started (torchrun's workers too, which a
    plain subprocess timeout would leave running), and the test fails saying so."""
    done, timed_out = run_or_kill(command, env, timeout)
    if timed_out:
        pytest.fail(f"{command[:6]} ran past {timeout} s (killed with every process it started): "
                    f"{done.stderr[-3000:]}")
    return done


def run_to_success(command: list[str], env: dict[str, str], timeout: int = 600):
    done = run_group(command, env, timeout)
    if done.returncode != 0 and "terminate called without an active exception" in done.stderr:
        # A gloo thread aborting at interpreter exit, after the work (seen twice in ~10 suite runs before the
        # process group was destroyed at exit): launch once more rather than fail on teardown.
        done = run_group(command, env, timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def run_groups(commands: list[list[str]], env: dict[str, str], out: Path, timeout: int = 600) -> list[int]:
    """Run ``commands`` at once, the output of each in ``out/<i>.log``; past ``timeout`` each is killed with every
    process it started, and the test fails. Their exit statuses."""
    import subprocess
    import time

    processes = []
    for i, command in enumerate(commands):
        with (out / f"{i}.log").open("w") as log:
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    if any(p.poll() is None for p in processes):
        for p in processes:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
        pytest.fail(f"{len(commands)} launches ran past {timeout} s (killed with every process they started); "
                    f"logs in {out}")
    return [p.returncode for p in processes]


def torchrun_processes(script, args, processes: int = 2, timeout: float = 300, env: dict | None = None) -> str:
    """Run ``script args`` in ``processes`` processes under torchrun (gloo on this machine, a free port, one thread
    each) and return its stdout; a failure fails the test with the processes' stderr, and a launch past ``timeout``
    is killed with every process it started (:func:`run_group`): a rank stuck in a collective must not outlive its
    test."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("WORLD_SIZE", None)
    done = run_group(torchrun(processes, str(script), *map(str, args)), env, int(timeout))
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
