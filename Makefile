# looplm — the two Quickstart targets set everything up on a fresh machine.
PY ?= python3
TORCH_VERSION ?= 2.13.0
# test processes (pytest-xdist; one torch thread each): one per logical CPU, at most 8; 0 = one process with two threads
TEST_WORKERS ?= $(shell $(PY) -c 'import os; print(min(8, os.cpu_count() or 1))')

.PHONY: install demo test bench clean

install:
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"   # CPU wheel lies on disk here; install it first
	$(PY) -m pip install -q -e '.[dev]'
	-$(PY) -m looplm.cli kernels build                   # the CPU extension, once per CPU and source version (optional: without it, the PyTorch reference)

demo: install
	$(PY) -m looplm.cli demo

test: install
	$(PY) -m pytest -x -n $(TEST_WORKERS) --dist loadfile tests --durations=15   # a file's tests share one worker (module fixtures build once)

bench: install
	$(PY) benchmarks/bench_vs_hf.py
