#!/usr/bin/env bash
# Sets up a Python >= 3.12 virtual environment in .venv (once) and runs one job in it.
#   ./dev.sh demo    generate with the embedded tiny Qwen model and print KV statistics
#   ./dev.sh test    run the test suite (CPU; Pallas kernels in interpret mode; README.md says how long it takes;
#                    ./dev.sh test -m "not slow" for the quick subset)
#   ./dev.sh <cmd>   run any command inside the environment, e.g. ./dev.sh python -m jaxpaged --help
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  local cand
  for cand in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv keeps interpreters out of PATH unless selected: look there too.
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$cand" ] && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
  PY=$(find_python) || { echo "jaxpaged needs Python >= 3.12 and none was found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "creating .venv with $PY" >&2
  rm -rf .venv
  "$PY" -m venv .venv
fi
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
  # uv installs the dependencies in parallel (about 10 s from an empty cache against pip's ~100 s); pip
  # is the fallback where uv cannot be installed.
  # (quiet: setuptools warns about every editable install of a package-dir mapping, which is intended here)
  if .venv/bin/python -m pip install -q uv 2>/dev/null && [ -x .venv/bin/uv ]; then
    PYTHONWARNINGS=ignore .venv/bin/uv pip install -q --python .venv/bin/python -e '.[test]'
  else
    .venv/bin/python -m pip install -q --upgrade pip
    PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e '.[test]'
  fi
  touch .venv/.installed
fi

# Byte-compiled modules are kept under .venv, written by the first process that imports a module and read by
# every later one: where the environment sets PYTHONDONTWRITEBYTECODE, each Python process (the test workers,
# and the CLI, server, notebook and benchmark subprocesses the tests start) would otherwise compile jax's,
# transformers' and jaxpaged's sources again on import.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$PWD/.venv/pycache"

job=${1:-demo}
shift || true
case "$job" in
  demo) exec .venv/bin/python -m jaxpaged demo "$@" ;;
  # As many workers as cores: with byte-compiled modules kept, a worker more than the cores made the suite
  # slower, no longer faster (README: the suite's time).
  test) exec .venv/bin/python -m pytest tests -n "$(nproc)" --dist worksteal --durations=10 "$@" ;;
  *) exec .venv/bin/"$job" "$@" ;;
esac
