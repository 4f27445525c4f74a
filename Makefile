# The README's commands. `make demo` runs the multi-rank balanced training demo;
# `make test` runs the whole test suite; `make bench` prints the planning benchmark.
PYTHON ?= python3
VENV ?= .venv
TORCH_REQUIREMENTS ?= requirements/torch-cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench bench-e2e bench-engine gpu-check lint clean

install: $(STAMP)

$(STAMP): pyproject.toml $(TORCH_REQUIREMENTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r $(TORCH_REQUIREMENTS)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/bench_planning.py

# Real ranks (2 gloo CPU ranks; GPUs where every rank has one), forward and backward, without and with
# balancing, plus the cost models' prediction error. The default mix is 4 samples per rank; the demo's
# 2 per rank follows, where single images outweigh the mean load more often. Per-image timings:
# demo_output/bench_e2e_timings.csv.
bench-e2e: $(STAMP)
	$(PY) benchmarks/bench_e2e.py --batch-size 4 --steps 12 --timings-out demo_output/bench_e2e_timings.csv
	$(PY) benchmarks/bench_e2e.py --batch-size 2

# The engine's own machinery next to its floors: the status gather, bookkeeping at 20,000 images,
# and the overlapped pixel trip (2 gloo CPU ranks).
bench-engine: $(STAMP)
	$(PY) benchmarks/bench_engine.py

# The CUDA paths (tests/test_cuda.py) on a machine with a GPU, with that machine's own Python and
# CUDA build of torch (no venv: this repo's pins the CPU wheel). Two ranks share the first GPU.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/test_cuda.py

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) demo_output .pytest_cache .ruff_cache
