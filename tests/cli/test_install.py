"""grpokit as a user installs it: built from this tree and pip-installed (not editable) into a fresh virtual
environment, run from that environment's ``bin/grpokit`` with PYTHONPATH unset, it knows its version and trains a
recipe packaged inside it (``recipe:arithmetic``, read through importlib.resources).

The environment sees the packages of the Python that runs the suite, a virtual environment's or the system's (a
``.pth`` file adds its site directories: torch and transformers are not downloaded), and borrows its pip and
setuptools, so nothing needs the network. About a minute. Skipped, with the reason, where no virtual environment can
be made or that Python has no setuptools recent enough to build grpokit with."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The virtual environment's bin directory, with grpokit pip-installed from a copy of this tree, and the
    environment (no PYTHONPATH, no package index) to run it in."""
    tmp = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if run([sys.executable, "-c", "import setuptools, pip"], env=env).returncode:
        pytest.skip("this Python has no pip or setuptools to build grpokit with offline (--no-build-isolation)")
    import setuptools
    from packaging.requirements import Requirement

    needed = Requirement(re.search(r'^requires = \["(setuptools[^"]*)"', (ROOT / "pyproject.toml").read_text(),
                                   re.MULTILINE).group(1))
    if setuptools.__version__ not in needed.specifier:
        pytest.skip(f"this Python's setuptools {setuptools.__version__} cannot build grpokit ({needed}): "
                    "pip install -e '.[dev]' installs one that can")
    # Built from a copy: the build writes build/ and *.egg-info next to the sources it builds.
    source = tmp / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    venv = tmp / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", venv], env=env)
    if made.returncode:
        pytest.skip(f"cannot make a virtual environment: {made.stderr.strip()[-300:]}")
    # --system-site-packages would show the base interpreter's packages, not those of a virtual environment running
    # the suite: add this Python's own site directories (their .pth files read too), after the environment's own.
    purelib = run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=env)
    sites = [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages") and Path(path).is_dir()]
    (Path(purelib.stdout.strip()) / "suite_packages.pth").write_text(
        f"import site; list(map(site.addsitedir, {sites!r}))\n")
    # The machine's pip, run by the environment's Python, installs into the environment.
    pip = run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-build-isolation", source], env=env)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    return venv / "bin", env


def test_a_pip_installed_grpokit_trains_a_packaged_recipe(installed, tiny_model_dir, tmp_path):
    bin, env = installed
    where = run([bin / "python", "-c", "import grpokit; print(grpokit.__file__)"], env=env, cwd=tmp_path)
    assert where.stdout.startswith(str(bin.parent)), where.stdout + where.stderr  # the installed copy, not src/

    version = run([bin / "grpokit", "--version"], env=env, cwd=tmp_path)
    pyproject = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert version.returncode == 0 and version.stdout.strip() == f"grpokit {pyproject}", version.stderr

    train = run([bin / "grpokit", "train", "recipe:arithmetic", "--model", tiny_model_dir, "--max_steps", "1",
                 "--output_dir", tmp_path / "run", "--max_completion_length", "16", "--progress_bar", "false"],
                env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["step"] == 1 and "reward" in metrics

    listed = run([bin / "grpokit", "recipes"], env=env, cwd=tmp_path)
    assert listed.returncode == 0 and "recipe:tools" in listed.stdout
