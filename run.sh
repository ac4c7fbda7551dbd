#!/usr/bin/env bash
# Two commands from a fresh clone:
#   ./run.sh train [overrides]   set up .venv, then prepare data, train, evaluate and checkpoint the tiny model
#                                (run it again to resume; any `hybridtron train` flag works, e.g. --train.max_steps 200)
#   ./run.sh test                set up .venv-dev with the dev extras, then lint and run the whole test suite
# Two environments, because they must differ: .venv is what a user has (the project and its dependencies; on a GPU
# machine add the peer kernels with HYBRIDTRON_EXTRAS=gpu,fp8), .venv-dev adds the test tools and the kernel
# packages CI tests on the CPU (triton, fla-core, torchao). fla-core installed beside a CPU-only torch makes
# transformers bind fla's GPU kernels into every Qwen3.5 model it loads, which then fail on CPU tensors
# (docs/export.md#loading-on-a-cpu). The test suite runs the README's commands in .venv, as a user would.
# Environment: PYTHON (interpreter for the venvs, default python3), HYBRIDTRON_VENV (default .venv),
# HYBRIDTRON_DEV_VENV (default .venv-dev), HYBRIDTRON_EXTRAS (extras for .venv, e.g. gpu,fp8; default none),
# TORCH_SPEC (pip requirement for torch, default torch==2.13.0; install a CUDA build this way on a GPU box).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${HYBRIDTRON_VENV:-.venv}
DEV_VENV=${HYBRIDTRON_DEV_VENV:-.venv-dev}
EXTRAS=${HYBRIDTRON_EXTRAS:-}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

# setup VENV EXTRAS: create VENV when missing, install torch and the project (with EXTRAS, comma-separated) into it
# when pyproject.toml changed since the last install, and put it first on PATH.
setup() {
    local VENV=$1 extras=$2
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
    local stamp="$VENV/.installed-${extras:-base}"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        # torch first and pinned: a bare `torch` requirement on an empty env would pull a multi-GB CUDA build.
        python -c "import torch" 2>/dev/null || python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
        python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
        touch "$stamp"
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    train)
        setup "$VENV" "$EXTRAS"
        hybridtron train "$@"
        ;;
    test)
        # the user's environment first: tests/test_user_commands.py runs the README's commands in it
        setup "$VENV" "$EXTRAS"
        export HYBRIDTRON_USER_VENV
        HYBRIDTRON_USER_VENV=$(cd "$VENV" && pwd)
        setup "$DEV_VENV" dev
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
