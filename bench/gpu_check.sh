#!/usr/bin/env bash
# One command for the GPU check (see bench/gpu_check.py): bench/compare.py's link comparison over the real
# host link. Profile a GPT-2-sized workload; train no plan, per-block checkpointing, offload-all, and regen's
# recompute, swap and hybrid plans at 50% and at the peers' peaks; print max_memory_allocated next to
# max_memory_reserved and the measured step time next to the predicted one. Without CUDA it says so, exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1
exec timeout 290 "$PY" bench/gpu_check.py "$@"
