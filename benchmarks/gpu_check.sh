#!/usr/bin/env bash
# The one-command GPU check (see benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh OUTDIR
# A GPU machine lent for minutes has PyTorch's stack and no network: the project is installed
# from this checkout first where it is not (without its dependencies: the check needs none of
# IPython, Spark or plotly). PYTHON: the interpreter that holds torch (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! (cd / && "$PYTHON" -c "import ddl_magic.kernels") 2>/dev/null; then
    echo "installing ddl_magic from $(pwd) (no dependencies, no network) ..."
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
