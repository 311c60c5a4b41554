#!/usr/bin/env bash
# One command for the GPU check (bench/gpu_check.py): regen's CUDA path and bench/compare.py's link
# comparison over the real host link, under 5 minutes. Made for a bare GPU machine (docs/limitations.md, "how
# to run it on a lent GPU"): its plain python3 with its own torch, no venv, nothing installed; the wheels that
# bench/gpu_wheels.sh downloaded into .whl/ (pulp, highspy) are installed into /tmp/site when present, and the
# repo root goes on PYTHONPATH. Without CUDA it says so and exits 0 (--cpu-dry-run runs its code on CPU).
# `--compiled` runs bench/compiled.py instead: compiled recompute and hybrid plans (the compiler offloading the
# hybrid's swaps) beside activation_memory_budget.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            2> /dev/null; then
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else  # made for the GPU machine's Python 3.12 on x86-64 (bench/gpu_wheels.sh); this Python has its own
        echo "gpu_check: the wheels in .whl/ do not install for this Python; going on with its own packages"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = "--compiled" ]; then  # compiled plans beside torch.compile's budget (bench/compiled.py), Llama at size gpu
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
        echo "gpu_check --compiled: no CUDA device here; nothing to check"
        exit 0
    fi
    exec timeout 300 "$PY" bench/compiled.py --device cuda --size gpu --budgets 0.5 --strategies recompute hybrid --steps 10
fi
exec timeout 300 "$PY" bench/gpu_check.py "$@"
