"""Every benchmark script still runs: each with ``--smoke`` (tiny models, a step or two, its outputs in a temporary
directory), so that a change that breaks a benchmark fails here rather than on the day someone next measures.

The scripts run in this process (``main(argv)``), as Python would run them (their own directory first on the import
path): a fresh process per script would spend more on imports than the scripts take."""

import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MODULES = ("common.py", "grpokit_steps.py")  # imported by the scripts, not run
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if path.name not in MODULES)
# what a smoke run must leave as it was
KEPT = [BENCHMARKS / "results", BENCHMARKS.parent / "docs"]


def files_and_times() -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for root in KEPT for path in root.rglob("*") if path.is_file()}


@pytest.fixture
def as_a_script(monkeypatch, tmp_path):
    """The benchmarks' directory first on the import path, and what a script changes for its whole process put
    back: the environment (a smoke run's warm-start cache), torch's threads, transformers' progress bars."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path / "cache"))  # a smoke run points it at its own directory
    threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    yield
    sys.modules.pop("common", None)  # a fresh smoke directory for the next script
    torch.set_num_threads(threads)
    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


def test_every_script_is_found():
    assert {"vs_trl.py", "decode_roofline.py", "grpo_vs_ppo.py"} <= {path.name for path in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_the_benchmark_runs_at_smoke_size(script, as_a_script, capsys):
    before = files_and_times()
    runpy.run_path(str(script), run_name="benchmark")["main"](["--smoke"])
    assert capsys.readouterr().out.strip()  # each prints its records or its table
    assert files_and_times() == before
