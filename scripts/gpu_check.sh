#!/usr/bin/env bash
# One prepared check for whoever has a GPU: about five minutes on one GPU, loopback only,
# nothing downloaded (lattica_lab/gpu_check.py says what it runs). The last line is one JSON
# object; the exit status is 0 when every phase passed.
#
#   bash scripts/gpu_check.sh                        # on a machine with CUDA
#   bash scripts/gpu_check.sh --device cpu --quick   # a dry run of the check itself, on the CPU
#   bash scripts/gpu_check.sh --ranks                # a node of several GPUs (train.devices), ~4 min
#   bash scripts/gpu_check.sh --ranks --device cpu --quick   # its dry run with two CPU ranks
#
# The interpreter is $PYTHON, else this checkout's .venv, else python3 (a machine staged with
# .gpu/install.sh has Lattica's dependencies on python3's path).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m lattica_lab.gpu_check "$@"
