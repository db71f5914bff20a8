#!/usr/bin/env bash
# Runs the given test files again under the machine's system python3 ($SYSTEM_PYTHON, default /usr/bin/python3)
# when it is another interpreter than $PYTHON, the one `make test` used. The README promises both; they can differ
# in how they pickle (Debian 12's Python 3.11.2 writes an Enum member as getattr(Enum, "NAME"), every other Python as
# Enum(value): see tp_train/checkpoint/safe_load.py), and CI's python3 on PATH is another build.
#
# Its own virtual environment, .venv-system. Where the two interpreters share a minor version (and so the ABI of
# compiled packages), it reads $PYTHON's installed packages through a .pth file instead of installing them again,
# which saves CI a minute and a half; otherwise scripts/setup.sh installs them into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
SYSTEM_PYTHON=${SYSTEM_PYTHON:-/usr/bin/python3}
VENV=.venv-system

describe='import platform, sys; print(platform.python_version(), sys.base_prefix)'
if [ ! -x "$SYSTEM_PYTHON" ]; then
    echo "system-python: not run, there is no $SYSTEM_PYTHON"
    exit 0
fi
read -r version base <<<"$("$SYSTEM_PYTHON" -c "$describe")"
read -r tested_version tested_base <<<"$("$PYTHON" -c "$describe")"
if [ "$version $base" = "$tested_version $tested_base" ]; then
    echo "system-python: not run again, $SYSTEM_PYTHON (Python $version) is the interpreter the suite just ran on"
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    if ! "$SYSTEM_PYTHON" -m venv --without-pip "$VENV" >/dev/null 2>&1; then
        rm -rf "$VENV"
        echo "system-python: not run, $SYSTEM_PYTHON -m venv failed (on Debian/Ubuntu: apt install python3-venv)"
        exit 0
    fi
    if [ "${version%.*}" = "${tested_version%.*}" ]; then
        site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        own=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "import site; site.addsitedir('$site')" >"$own/tested-packages.pth"
    else
        rm -rf "$VENV" && "$SYSTEM_PYTHON" -m venv "$VENV"
        PYTHON="$VENV/bin/python" bash scripts/setup.sh
    fi
fi
echo "system-python: $* under $SYSTEM_PYTHON (Python $version), beside $PYTHON (Python $tested_version)"
workers=${TEST_WORKERS:-$(($# > 1 ? 2 : 0))}  # one file: one process, no worker to start
"$VENV/bin/python" -m pytest -q -n "$workers" --dist loadfile -p no:cacheprovider "$@"
