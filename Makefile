# regen: `make test` runs the test suite, `make demo` runs the main job end to end.
# Both create .venv when it is missing and install regen into it. The CPU build of torch is pinned
# here (not in pyproject.toml, where users bring their own torch) so a fresh machine installs it
# from local disk instead of pulling a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.regen-installed

.PHONY: test demo install clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[test,plot]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile tests

demo: $(STAMP)
	$(VENV)/bin/regen demo

bench: $(STAMP)
	$(PY) bench/compare.py

clean:
	rm -rf $(VENV) demo-output
