# Sourced by the install, demo and test scripts: sets PYTHON, the interpreter they install grpokit into and run.
# $PYTHON if set; else the active venv's or conda environment's python3; else, as root, the system's python3 (CI's
# machine); else a venv here, .venv, made on first use by `python3 -m venv` (a normal user's system Python takes no
# packages: PEP 668).
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] || [ "$(id -u)" = 0 ]; then
    PYTHON=python3
  else
    if [ ! -x .venv/bin/python ]; then
      echo "making a virtual environment for grpokit: $PWD/.venv (python3 -m venv)"
      python3 -m venv .venv
    fi
    PYTHON=$PWD/.venv/bin/python
  fi
fi
export PYTHON
