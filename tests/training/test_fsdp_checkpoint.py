"""Scaling out without losing work, with 2 gloo CPU processes under torchrun: FSDP2 checkpoints resume bit-exact; a
checkpoint is resumed only by as many processes as wrote it; a rank SIGKILLed mid-run under ``torchrun
--max-restarts 1`` is restarted and the run ends bit-identical to one never interrupted (DDP and FSDP2), never
reading a checkpoint that was half-written; two torchrun "nodes" end where one process ends.

Every launch runs in a process group of its own, killed whole on timeout (helpers.run_group)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.training.checkpoint import CheckpointError, verify
from helpers import run_group, run_to_success, torchrun

TESTS = Path(__file__).parents[1]
STEPS = 4

# Each leg ([output_dir, max_steps, resume, layout]: ddp, fsdp or ppo-fsdp) trains a fresh trainer in this process. KILL
# (rank 1, first attempt only: torchrun counts restarts in TORCHELASTIC_RESTART_COUNT) is "after:K": SIGKILL once
# checkpoint K is published; "write:K": once this process has written its shards of checkpoint K, before it is
# published.
SCRIPT = textwrap.dedent(f"""
    import json, os, signal, sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    torch.set_num_threads(1)
    import grpokit.training.sharded_checkpoint as shards
    from helpers import TINY, ROWS, ones
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.tasks.tiny_model import build_model, build_tokenizer

    rank = int(os.environ.get("RANK", 0))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kind, _, at = os.environ.get("KILL", "").partition(":")
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    for out, steps, resume, layout in json.loads(sys.argv[1]):
        algorithm, _, parallelism = layout.rpartition("-")  # "ppo-fsdp": PPO, its value model sharded too
        tokenizer = build_tokenizer()
        config = GRPOConfig(output_dir=out, prompts_per_step=4, num_generations=4, max_completion_length=6,
                            max_steps=steps, learning_rate=1e-2, progress_bar=False, save_every=1,
                            resume=resume or None, lr_schedule="constant", parallelism=parallelism,
                            algorithm=algorithm or "grpo", mixed_precision="no")
        trainer = GRPOTrainer(config, model=build_model(tokenizer, TINY, seed=0), tokenizer=tokenizer,
                              train_dataset=ROWS, reward_funcs=[ones])
        if rank == 1 and first_attempt and kind == "after":
            save = trainer.save_checkpoint
            trainer.save_checkpoint = lambda: (save(), trainer.step == int(at) and die())[0]
        if rank == 1 and first_attempt and kind == "write":
            write = shards.write_shards
            shards.write_shards = lambda state, staging: (write(state, staging), state["step"] == int(at) and die())[0]
        trainer.train()
""")


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def legs(tmp_path: Path, *runs: tuple[Path, int, str, str]) -> list[str]:
    script = tmp_path / "legs.py"
    script.write_text(SCRIPT)
    return [str(script), json.dumps([[str(out), *rest] for out, *rest in runs])]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model" / "model.safetensors"))


def assert_bit_identical(expected: Path, got: Path) -> None:
    """The same final weights, bit for bit, and the same metrics, each step logged once."""
    a, b = weights(expected), weights(got)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ours, theirs = ([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                    for run in (got, expected))
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    for a, b in zip(ours, theirs):
        assert {k: v for k, v in a.items() if not k.startswith("time_") and k != "tokens_per_sec"} == \
               {k: v for k, v in b.items() if not k.startswith("time_") and k != "tokens_per_sec"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One launch of 2 processes: FSDP2 runs (GRPO, and PPO with its value model) of STEPS steps, and ones stopped
    after 2."""
    tmp = tmp_path_factory.mktemp("straight")
    runs = {f"{layout}{leg}": tmp / f"{layout}{leg}" for layout in ("fsdp", "ppo-fsdp") for leg in ("", "-2")}
    run_to_success([*torchrun(2), *legs(tmp, *((runs[layout], STEPS, "", layout) for layout in ("fsdp", "ppo-fsdp")),
                                        *((runs[f"{layout}-2"], 2, "", layout) for layout in ("fsdp", "ppo-fsdp")))],
                   environment(), timeout=400)
    return runs


@pytest.fixture(scope="module")
def straight_ddp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight-ddp")
    run_to_success([*torchrun(2), *legs(tmp, (tmp / "ddp", STEPS, "", "ddp"))], environment(), timeout=400)
    return tmp / "ddp"


def test_fsdp_resume_is_bit_exact(straight, tmp_path):
    """2 FSDP2 steps, then resumed (new processes, `--resume latest`) to 4: bit-identical to 4 straight steps, for GRPO
    and PPO (its value model and optimizer sharded too). The checkpoint holds both processes' shards, the whole policy
    as a transformers directory, and a manifest."""
    path = straight["fsdp-2"] / "checkpoints" / "step-000002"
    verify(path)
    assert sorted(p.name for p in (path / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = json.loads((path / "state.json").read_text())
    assert (state["layout"], state["world_size"]) == ("sharded", 2)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path / "model")  # the exported policy stays a save_pretrained directory
    for layout in ("fsdp", "ppo-fsdp"):
        shutil.copytree(straight[f"{layout}-2"], tmp_path / layout)
    run_to_success([*torchrun(2), *legs(tmp_path, *((tmp_path / layout, STEPS, "latest", layout)
                                                     for layout in ("fsdp", "ppo-fsdp")))], environment(), timeout=300)
    for layout in ("fsdp", "ppo-fsdp"):
        assert_bit_identical(straight[layout], tmp_path / layout)
    for part in ("model.safetensors", "value_head.safetensors"):  # the value model, exported beside the policy
        a, b = (load_file(str(run / "value_model" / part)) for run in (straight["ppo-fsdp"], tmp_path / "ppo-fsdp"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_another_number_of_processes_is_refused(straight, tokenizer, tiny_model, tmp_path):
    """A 2-process FSDP2 checkpoint resumed by 1 process: refused, naming both counts (each process's sampling stream
    is in it, seeded by its rank: another layout could not continue the run exactly)."""
    from helpers import make_trainer

    trainer = make_trainer(tokenizer, tiny_model, tmp_path, parallelism="fsdp")
    with pytest.raises(CheckpointError, match=r"written by 2 processes; resume it with the same number \(now 1\)"):
        trainer.resume(str(straight["fsdp-2"] / "checkpoints" / "step-000002"))


@pytest.mark.slow_distributed
@pytest.mark.parametrize("parallelism, kill", [("ddp", "after:2"), ("fsdp", "write:3")],
                         ids=["ddp-killed-after-a-checkpoint", "fsdp-killed-while-a-checkpoint-is-written"])
def test_a_killed_worker_is_restarted_and_ends_bit_identical(request, tmp_path, parallelism, kill):
    """Rank 1 SIGKILLed mid-run (DDP: once checkpoint 2 is published; FSDP2: once it has written its shards of
    checkpoint 3, which is never published) under torchrun --max-restarts 1 with resume: auto. torchrun restarts
    both processes; they resume from step 2, the newest complete checkpoint (the half-written one is not read, and the
    next save removes it), and end bit-identical to the run never interrupted."""
    out = tmp_path / "run"
    done = run_group([*torchrun(2, "--max-restarts=1"), *legs(tmp_path, (out, STEPS, "auto", parallelism))],
                     {**environment(), "KILL": kill}, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resume: auto: no checkpoint under" in done.stderr  # the first attempt started afresh
    assert f"resume: auto: from {out / 'checkpoints' / 'step-000002'} (step 2)" in done.stderr  # the restart
    expected = request.getfixturevalue("straight")["fsdp"] if parallelism == "fsdp" else \
        request.getfixturevalue("straight_ddp")
    assert_bit_identical(expected, out)
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step-000003", "step-000004"]  # (keep_checkpoints: 2) and no .tmp-* left
    for name in checkpoints:
        verify(out / "checkpoints" / name)


def test_lora_with_fsdp_is_refused_before_any_work():
    """peft can neither save nor merge a sharded adapter: no checkpoint or model could be written, so the config is
    refused."""
    from grpokit import GRPOConfig
    from grpokit.config import ConfigError

    with pytest.raises(ConfigError, match="lora_rank with parallelism: fsdp is not supported yet"):
        GRPOConfig(lora_rank=4, parallelism="fsdp")


def test_shard_metadata_that_would_run_code_is_refused(straight, tmp_path):
    """DCP's .metadata is a pickle: a crafted one (here calling os.system) is refused by the unpickler before anything
    runs, and the real one reads back."""
    import pickle

    from grpokit.training.sharded_checkpoint import SafeReader

    shards = straight["fsdp-2"] / "checkpoints" / "step-000002" / "shards"
    assert SafeReader(str(shards)).read_metadata().state_dict_metadata
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match=r"posix.system is not part of a checkpoint's shard metadata"):
        SafeReader(str(tmp_path)).read_metadata()
    assert not marker.exists()


def test_shard_metadata_may_name_an_enum_member_by_getattr_and_nothing_else():
    """Some Pythons (Debian 12's 3.11.2) pickle an enum member as getattr(its enum, its name): that member loads;
    any other attribute through getattr is refused before it is called."""
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from grpokit.training.sharded_checkpoint import _MetadataUnpickler

    class ByName:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def __reduce__(self):
            return (getattr, (self.owner, self.name))

    def load(owner, name):
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(ByName(owner, name)))).load()

    assert load(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT") is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    for name in ("__init_subclass__", "_missing_", "nope"):
        with pytest.raises(pickle.UnpicklingError, match=r"getattr\(.* is not part of a checkpoint's shard metadata"):
            load(_MEM_FORMAT_ENCODING, name)


def test_a_timed_out_launch_is_killed_with_what_it_started(tmp_path):
    """helpers.kill_tree (run_group's timeout): the launch and the process it started (as torchrun starts its
    workers) are both killed."""
    import time

    from helpers import kill_tree

    child = tmp_path / "child"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(300)']); open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    launch = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (child.exists() and child.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_tree(launch.pid)
    assert launch.wait(timeout=10) == -signal.SIGKILL
    pid, deadline = int(child.read_text()), time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # killed; gone once reaped
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        assert not Path(f"/proc/{pid}").exists()


CHECK = Path(__file__).parents[2] / "scripts" / "distributed_check.py"


def test_the_gpu_check_plans_its_launches(tmp_path):
    """scripts/gpu_check.sh's distributed check (scripts/distributed_check.py) on a machine without GPUs: its plan."""
    done = subprocess.run([sys.executable, str(CHECK), "--dry-run", "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 process(es), backend gloo, device cpu, model tiny, 4 steps (resumed after 2)")
    assert done.stdout.count("torchrun --nproc_per_node 2") == 2


@pytest.mark.slow_distributed
def test_the_gpu_check_passes_with_gloo_on_the_cpu(tmp_path):
    """The check itself, with 2 gloo processes: DDP and FSDP2 resumed bit-exact, a PASS table."""
    done = run_group([sys.executable, str(CHECK), "--cpu", "--processes", "2", "--steps", "2", "--out", str(tmp_path)],
                     environment(), timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    for parallelism in ("ddp", "fsdp"):
        assert f"| {parallelism} | gloo | 2 | PASS | bit-exact |" in done.stdout
