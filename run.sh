#!/usr/bin/env bash
# Two commands from a fresh clone:
#   ./run.sh train [overrides]   set up .venv, then prepare data, train, evaluate and checkpoint the tiny model
#                                (run it again to resume; any `hybridtron train` flag works, e.g. --train.max_steps 200)
#   ./run.sh test                set up .venv with the dev extras, then lint and run the whole test suite
# Environment: PYTHON (interpreter for the venv, default python3), HYBRIDTRON_VENV (default .venv),
# TORCH_SPEC (pip requirement for torch, default torch==2.13.0; install a CUDA build this way on a GPU box).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${HYBRIDTRON_VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

setup() {
    local extras=$1
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[run.sh] creating virtual environment $VENV"
        if ! "$PYTHON" -m venv "$VENV"; then
            echo "[run.sh] error: '$PYTHON -m venv' failed; on Debian/Ubuntu install python3-venv" \
                 "(apt-get install python3-venv), or set PYTHON to another interpreter" >&2
            rm -rf "$VENV"
            exit 1
        fi
    fi
    if [ -f "$VENV/bin/activate" ]; then
        # shellcheck disable=SC1091
        . "$VENV/bin/activate"
    else  # an interpreter prefix that is not a venv (e.g. a conda or pyenv install)
        export PATH="$VENV/bin:$PATH"
    fi
    local stamp="$VENV/.installed-$extras"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        # torch first and pinned: a bare `torch` requirement on an empty env would pull a multi-GB CUDA build.
        python -c "import torch" 2>/dev/null || python -m pip install -q "$TORCH_SPEC"
        python -m pip install -q -e ".[$extras]"
        touch "$stamp"
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    train)
        setup dev
        hybridtron train "$@"
        ;;
    test)
        setup dev
        ruff check .
        # pytest exits 5 when it collected nothing; set -e turns that (and any failure) into a failed run.
        # One worker per core (pytest-xdist), each test file on one worker (its module fixtures built once); the
        # 15 slowest tests, timed, in every run.
        python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
        ;;
    *)
        echo "usage: ./run.sh train [--train.max_steps N ...] | ./run.sh test [pytest args]" >&2
        exit 2
        ;;
esac
