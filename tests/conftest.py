"""Fixtures for every test folder: the tiny model and tokenizer (fresh, or saved as a checkpoint), a data file,
the default dtype, the sandbox's isolations. Shared builders that are not fixtures are in helpers.py."""

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import helpers
from grpokit.sandbox import Sandbox, SandboxUnavailable
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TINY, no_sandbox, sandbox_python


def pytest_addoption(parser):
    parser.addoption("--require-sandbox", action="store_true",
                     help="fail, not skip, the tests of a sandbox that cannot start (CI, the mutation audit)")


def pytest_configure(config):
    helpers.REQUIRE_SANDBOX = config.getoption("require_sandbox")


# Under the mutation audit (scripts/mutation_judges.py sets these): each test session runs in a cgroup of its own, with
# a cap on processes and a wall clock, so that a mutant that lifts the sandbox's process bound lets the hostile tests'
# fork bombs exhaust that cgroup only, not the machine's pids nor mutmut's own processes. The session's process returns
# to the parent cgroup when it ends; past the wall clock it ends what is in it, and itself with mutmut's timeout code.
AUDIT_CGROUP = Path(os.environ["MUTATION_AUDIT_CGROUP"]) if os.environ.get("MUTATION_AUDIT_CGROUP") else None
AUDIT_SECONDS = float(os.environ.get("MUTATION_AUDIT_SESSION_SECONDS", "0"))
_watchdog: list[threading.Timer] = []


def _end_the_cgroup(code: int | None) -> None:
    """SIGKILL every process in the audit's cgroup (what an earlier mutant's bomb left, or this one's) but this one
    and its ancestors (mutmut's); with a ``code``, end this process too."""
    ancestors, pid = set(), os.getpid()
    while pid > 1:
        ancestors.add(pid)
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    for pid in map(int, (AUDIT_CGROUP / "cgroup.procs").read_text().split()):
        if pid not in ancestors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if code is not None:
        os._exit(code)


def pytest_sessionstart(session):
    if AUDIT_CGROUP:
        _end_the_cgroup(None)
        (AUDIT_CGROUP / "cgroup.procs").write_text(str(os.getpid()))
        if AUDIT_SECONDS:
            _watchdog.append(threading.Timer(AUDIT_SECONDS, _end_the_cgroup, args=(36,)))  # 36: mutmut's timeout
            _watchdog[-1].daemon = True
            _watchdog[-1].start()


def pytest_sessionfinish(session, exitstatus):
    for timer in _watchdog:
        timer.cancel()
    if AUDIT_CGROUP:
        (AUDIT_CGROUP.parent / "cgroup.procs").write_text(str(os.getpid()))


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    """A randomly initialised 2-layer Llama over the built-in character tokenizer."""
    return build_model(tokenizer, TINY, seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny model and tokenizer saved with save_pretrained, as a user's checkpoint would be."""
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_tokenizer()
    build_model(tokenizer, TINY, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def float64_default():
    """Tensors made without a dtype are float64 within the test: transformers 4.50 builds GPT-2's causal mask in the
    default dtype, which a float64 model's smallest value overflows while that is float32."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.fixture
def data_file(tmp_path):
    """A JSONL file of 10 arithmetic rows, for `grpokit train` configs (``helpers.write_config``)."""
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(10, 20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def sandbox_refusals():
    """Isolation → why the sandbox cannot start with it here (None where it can)."""
    refusals = {}
    for isolation in ("bwrap", "process"):
        try:
            Sandbox(isolation=isolation)
            refusals[isolation] = None
        except SandboxUnavailable as error:
            refusals[isolation] = str(error)
    return refusals


@pytest.fixture(params=["process", "bwrap"])
def isolation(request, sandbox_refusals):
    """Each isolation of the sandbox, by name, run by this interpreter; its tests skip, saying why, where it cannot
    start (fail under --require-sandbox, except the process isolation refusing, as root, an interpreter that others
    cannot read: by design, and the tests that run /usr/bin/python3 there cover it)."""
    refusal = sandbox_refusals[request.param]
    if refusal is not None:
        reason = f"the sandbox cannot start with isolation {request.param} here: {refusal}"
        if sandbox_python(request.param) is not None:
            pytest.skip(reason)
        no_sandbox(reason)
    return request.param


@pytest.fixture
def any_isolation(sandbox_refusals):
    """An isolation the sandbox starts with here (bwrap first), for tests of what runs in it, not of how."""
    usable = [name for name, refusal in sandbox_refusals.items() if refusal is None]
    if not usable:
        no_sandbox(f"the sandbox cannot start here: {sandbox_refusals}")
    return usable[0]


# tests/agents/vf_v1_env's packages import verifiers 0.4, which the default suite's environment lacks: they are
# environments for tests/agents/test_verifiers_v1*.py to load, not tests (--doctest-modules would import them).
collect_ignore = ["agents/vf_v1_env"]


@pytest.fixture
def agent_trainer(tmp_path):
    """``agent_trainer(agent, rows, **config)``: a GRPOTrainer driven by ``agent`` on the tiny model with a Hermes
    tool-call chat template (tests/agents), one step by default, a fresh output_dir each call."""
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.tasks.tiny_model import build_model
    from helpers import HERMES, TEMPLATE_SPEC, tokenizer_with

    tok = tokenizer_with(HERMES)
    runs = iter(range(100))

    def make(agent, rows, reward_funcs=None, **overrides):
        values = dict(output_dir=str(tmp_path / f"run{next(runs)}"), prompts_per_step=2, num_generations=4,
                      max_completion_length=8, learning_rate=1e-2, max_steps=1, micro_batch_size=8,
                      progress_bar=False, lr_schedule="constant", mixed_precision="no", agent_timeout=60.0)
        values.update(overrides)
        return GRPOTrainer(GRPOConfig(**values), model=build_model(tok, TEMPLATE_SPEC, seed=0), tokenizer=tok,
                           train_dataset=rows, reward_funcs=reward_funcs, agent=agent)

    return make
