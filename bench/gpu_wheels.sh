#!/usr/bin/env bash
# Download here the wheels that bench/gpu_check.sh needs on a bare GPU machine (no network there): pulp and
# highspy, at the versions installed here, for that machine's Python 3.12 on x86-64, into .whl/ at the repo
# root (ignored by git; the device tool takes it along with carry ['.whl']). Their other requirement, numpy,
# and regen's networkx and pyyaml are in that machine's image. `pip download` installs nothing.
#   PYTHON=/path/to/venv/bin/python bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
PULP="${PULP_VERSION:-$(version pulp)}"
HIGHSPY="${HIGHSPY_VERSION:-$(version highspy)}"
rm -rf .whl  # one version of each: two would stop the install there
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "pulp==$PULP" "highspy==$HIGHSPY"
for whl in .whl/*.whl; do  # what each needs besides itself (extras left out)
    echo "$(basename "$whl"): requires $(unzip -p "$whl" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
        | sed 's/^Requires-Dist: //' | paste -sd, - || true)"
done
du -sh .whl
