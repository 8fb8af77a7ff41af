#!/usr/bin/env bash
# The one-command GPU check (see benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
