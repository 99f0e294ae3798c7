#!/usr/bin/env bash
# The suite where users run it: as a normal user (not root), in a fresh venv that `python3 -m venv` makes (its
# python a symlink to the base interpreter) and activated as `source .venv/bin/activate` would, from a copy of this
# work tree (what git tracks, and new files it does not ignore) in that user's home. Run it as root (scripts/test.sh
# does, after the suite as root); arguments go to pytest. GRPOKIT_TEST_USER names the user (made if missing;
# default grpokit-test); GRPOKIT_TEST_PYTHON the base interpreter (default /usr/bin/python3, which the user can
# read, unlike a pyenv under /root).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "scripts/test_as_user.sh: run it as root: it makes the user and copies the work tree to it" >&2
  exit 2
fi
user=${GRPOKIT_TEST_USER:-grpokit-test}
base=${GRPOKIT_TEST_PYTHON:-/usr/bin/python3}
id -u "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
if ! "$base" -c "import ensurepip" 2>/dev/null; then  # Debian keeps venv's pip bootstrap apart
  apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
fi
home=$(getent passwd "$user" | cut -d: -f6)
tree=$home/grpokit
rm -rf "$tree"
mkdir -p "$tree"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$tree"
chown -R "$user:" "$tree"
echo "== the suite as $user (uid $(id -u "$user")) in a fresh venv from $base, in $tree"
# The machine's environment (its package index and certificate settings) less root's own: home, paths, Python's
runuser -u "$user" -- env -u PYTHONPATH -u PYTHON -u VIRTUAL_ENV -u CONDA_PREFIX -u PYENV_VERSION -u PYENV_ROOT \
  -u XDG_RUNTIME_DIR -u XDG_CONFIG_HOME -u XDG_CACHE_HOME -u XDG_DATA_HOME -u GRPOKIT_CACHE \
  HOME="$home" USER="$user" LOGNAME="$user" PATH=/usr/local/bin:/usr/bin:/bin \
  bash -c 'set -euo pipefail; cd "$1"; "$2" -m venv .venv; source .venv/bin/activate; shift 2
           bash scripts/test.sh "$@"' _ "$tree" "$base" "$@"
