# Two commands: `make train` (set up + run the main job) and `make test` (set up + run the test suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: setup train test clean

setup: $(VENV)/.installed

# torch goes in first, pinned, so no dependency can pull a CUDA build (the CPU wheel is on these machines).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

train: setup
	$(PY) jobs/train.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
