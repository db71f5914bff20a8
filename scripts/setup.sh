#!/usr/bin/env bash
# Installs tp_train (editable, with its test tools and the docs builder: the dev and docs extras) and the exact
# dependency versions of constraints.txt into the environment of $PYTHON (the Makefile's choice: an active venv or
# conda env, else .venv).
#
# .venv is created here when it is missing, from $BASE_PYTHON (default: python3 on PATH). A project venv, always
# rather than only where pip refuses (PEP 668's "externally-managed-environment" on Debian/Ubuntu's python3): the
# same set-up on every machine, and nothing installed into an interpreter the user did not choose.
#
# torch goes first: on a machine without an NVIDIA GPU we install the CPU build, because letting pip resolve a
# loose "torch" requirement pulls a multi-GB CUDA build. Override with TORCH_SPEC (e.g. TORCH_SPEC=torch); an
# environment's torch that imports is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
BASE_PYTHON=${BASE_PYTHON:-python3}

if [ "$PYTHON" = .venv/bin/python ] && [ ! -x .venv/bin/python ]; then
    if ! command -v "$BASE_PYTHON" >/dev/null 2>&1; then
        echo "error: setup needs $BASE_PYTHON (Python 3.10+) on PATH, or BASE_PYTHON=/path/to/python3" >&2
        exit 2
    fi
    if ! "$BASE_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        echo "error: $BASE_PYTHON is Python $("$BASE_PYTHON" -c 'import platform; print(platform.python_version())'); tp_train needs 3.10+ (set BASE_PYTHON)" >&2
        exit 2
    fi
    echo "setup: creating .venv with $(command -v "$BASE_PYTHON") (Python $("$BASE_PYTHON" -c 'import platform; print(platform.python_version())'))"
    if ! "$BASE_PYTHON" -m venv .venv >/dev/null; then
        rm -rf .venv  # a half-made venv would be taken for a working one next time
        echo "error: $BASE_PYTHON -m venv failed; on Debian/Ubuntu install the venv module: sudo apt install python3-venv" >&2
        exit 2
    fi
elif [ ! -x "$PYTHON" ] && ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: PYTHON=$PYTHON is not an interpreter (is the environment still there?)" >&2
    exit 2
fi

# `make test` and `make train` run this first: when the environment already holds this checkout's install of these
# exact requirements (the stamp names their hash) and its packages are all there, pip is not run again.
prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')
stamp="$prefix/.tp_train-setup"
wanted="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1) $(pwd)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] \
    && "$PYTHON" -I -c "
import importlib.util as u, sys
spec = u.find_spec('tp_train')
found = all(u.find_spec(name) for name in ('torch', 'lightning', 'transformers', 'datasets', 'hydra', 'wandb', 'pytest', 'xdist', 'mkdocs', 'material'))
sys.exit(not (found and spec and spec.origin.startswith('$(pwd)/')))" >/dev/null 2>&1; then
    echo "setup: $prefix already holds tp_train[dev,docs] with constraints.txt"
    exit 0
fi
if [ -z "${TORCH_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        TORCH_SPEC="torch"
    else
        TORCH_SPEC="torch==2.13.0"
    fi
fi
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing $TORCH_SPEC into $prefix"
    "$PYTHON" -m pip install --quiet --no-compile "$TORCH_SPEC"
fi
echo "setup: installing tp_train[dev,docs] with constraints.txt into $prefix"
"$PYTHON" -m pip install --quiet --no-compile -c constraints.txt -e ".[dev,docs]"
# The bytecode pip would have written one file at a time, on every core at once (55 s instead of 80 s for this
# set-up on 2 cores). Without it each process would compile its imports again where PYTHONDONTWRITEBYTECODE is set,
# as on CI. A few packages ship files that are not Python 3 on purpose, which compileall reports and pip ignored.
site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
echo "$wanted" > "$stamp"
