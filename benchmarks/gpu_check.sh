#!/usr/bin/env bash
# The one-command GPU check (see benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh OUTDIR
# A GPU machine lent for minutes has PyTorch's stack and no network: the project is installed
# from this checkout first where it is not (without its dependencies: the check needs none of
# IPython, Spark or plotly). PYTHON: the interpreter that holds torch (default: python3).
set -euo pipefail
PYTHON="${PYTHON:-python3}"
case "$PYTHON" in  # a path is the caller's, read before moving to the checkout; links kept (a venv's)
    */*) PYTHON="$(realpath -ms "$PYTHON")" ;;
esac
cd "$(dirname "$0")/.."
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu_check: '$PYTHON' cannot import torch. Name the Python that holds PyTorch:" \
         "PYTHON=/path/to/bin/python bash benchmarks/gpu_check.sh OUTDIR" >&2
    exit 2
fi
if ! (cd / && "$PYTHON" -c "import ddl_magic.kernels") 2>/dev/null; then
    echo "installing ddl_magic from $(pwd) (no dependencies, no network) ..."
    if ! "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .; then
        echo "gpu_check: could not install ddl_magic from $(pwd) into '$PYTHON' (offline, it" \
             "needs setuptools and wheel there). Install it yourself, then run this again:" \
             "$PYTHON -m pip install -e ." >&2
        exit 2
    fi
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
