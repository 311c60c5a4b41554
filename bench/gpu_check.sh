#!/usr/bin/env bash
# One command for the GPU check (see bench/gpu_check.py): profile a GPT-2-sized workload, solve at 50%
# (hybrid, recompute, swap), train 20 steps each and with per-block checkpointing, and compare measured
# peak and step time with the plans' predictions. Without a CUDA device it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1
exec timeout 290 "$PY" bench/gpu_check.py "$@"
