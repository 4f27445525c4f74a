# The README's commands. `make demo` runs the multi-rank balanced training demo;
# `make test` runs the whole test suite; `make bench` prints the planning benchmark.
PYTHON ?= python3
VENV ?= .venv
TORCH_REQUIREMENTS ?= requirements/torch-cpu.txt
TRANSFORMERS_REQUIREMENTS ?= requirements/transformers.txt
# DeepSpeed for the ZeRO tests; `DEEPSPEED_REQUIREMENTS=` skips it (those tests are then skipped).
DEEPSPEED_REQUIREMENTS ?= requirements/deepspeed.txt
# Tested versions of the other dependencies; `CONSTRAINTS=` installs the newest (use another VENV).
CONSTRAINTS ?= requirements/constraints.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The requirement files the environment was built from, by name: a call naming others (`make test
# TORCH_REQUIREMENTS=...`) rebuilds it, also where they are older than its last build.
REQUIREMENTS_NAMES := $(TORCH_REQUIREMENTS) $(TRANSFORMERS_REQUIREMENTS) $(DEEPSPEED_REQUIREMENTS) $(CONSTRAINTS)
REQUIREMENTS_USED := $(VENV)/.requirements-used

.PHONY: FORCE install test test-transformers4 test-torch-oldest demo bench bench-e2e bench-engine bench-memory bench-ranks bench-predict gpu-check bench-gpu plan-versions lint clean

install: $(STAMP)

# Rewritten (so newer than the build) only where the names differ from those it holds: a dry run
# (`make -n`) then tells the truth and writes nothing.
ifneq ($(strip $(shell cat $(REQUIREMENTS_USED) 2>/dev/null)),$(strip $(REQUIREMENTS_NAMES)))
$(REQUIREMENTS_USED): FORCE
endif
$(REQUIREMENTS_USED):
	@mkdir -p $(VENV)
	@echo '$(REQUIREMENTS_NAMES)' > $@

FORCE:

$(STAMP): pyproject.toml $(REQUIREMENTS_USED) $(TORCH_REQUIREMENTS) $(TRANSFORMERS_REQUIREMENTS) $(DEEPSPEED_REQUIREMENTS) $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r $(TORCH_REQUIREMENTS)
	$(PY) -m pip install --quiet -e ".[dev]" -r $(TRANSFORMERS_REQUIREMENTS) $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	$(if $(DEEPSPEED_REQUIREMENTS),$(PY) -m pip install --quiet --no-build-isolation -r $(DEEPSPEED_REQUIREMENTS) $(if $(CONSTRAINTS),-c $(CONSTRAINTS)))
	touch $(STAMP)

# Test files run in this many processes side by side (pytest-xdist; each file's tests stay in one,
# so the multi-rank pools it starts serve all of them): two keep both of a 2-core machine's cores
# busy while the other process waits on a subprocess's start or a timeout. `TEST_WORKERS=0` runs
# the suite in one process. More than the machine's cores slows it down: every rank is a process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The same suite against transformers 4.57 (the last 4.x), in its own virtual environment; CI runs
# it after `make test`.
test-transformers4:
	$(MAKE) test VENV=.venv-transformers4 TRANSFORMERS_REQUIREMENTS=requirements/transformers4.txt

# The same suite on the oldest releases the package supports, torch 2.9 and transformers 4.57, in
# a virtual environment of its own (without DeepSpeed: its ZeRO tests are skipped there). PyPI has no
# CPU build of torch 2.9 for x86-64: its CUDA build (about 7 GB installed) is not kept in pip's cache.
test-torch-oldest:
	PIP_NO_CACHE_DIR=1 $(MAKE) test VENV=.venv-torch-oldest TORCH_REQUIREMENTS=requirements/torch-oldest.txt \
		TRANSFORMERS_REQUIREMENTS=requirements/transformers4.txt DEEPSPEED_REQUIREMENTS=

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

# Inference (forward only, 2 gloo CPU ranks, the demo's tower and batches): direct calls whose ranks
# run apart, as in a predict loop, or meet at every batch, next to balanced calls, which meet.
bench-predict: $(STAMP)
	$(PY) benchmarks/bench_predict.py

# The engine's own machinery next to its floors: the status gather, skipped calls checked or not,
# bookkeeping at 20,000 images, videos planned by temporal step, and the overlapped pixel trip
# (2 gloo CPU ranks).
bench-engine: $(STAMP)
	$(PY) benchmarks/bench_engine.py

# Peak tensor memory per rank of one ViT forward and backward (torch.profiler's allocation events),
# unbalanced, balanced (also overlapped and prepared) and the plan alone without the exchange, on the
# demo's tower and batches (2 gloo CPU ranks); the method is checked on known cases first.
bench-memory: $(STAMP)
	$(PY) benchmarks/bench_memory.py

# The balancer on many ranks: one call's host work at 64-1024 ranks (in one process), then the host
# gathers (metadata, status) on 2-32 gloo CPU ranks, gloo's ring all_gather against the doubling
# rounds the balancer takes from 16 ranks on (3-4 minutes on 2 cores).
bench-ranks: $(STAMP)
	$(PY) benchmarks/bench_many_ranks.py

# On a machine with a GPU, with that machine's own Python and CUDA build of torch (no venv: this
# repo's pins the CPU wheel; PYTHONPATH is kept after the repo). gpu-check: the CUDA paths
# (tests/test_cuda.py, and the Hugging Face drop-in's in tests/test_cuda_hf.py), two ranks sharing the
# first GPU. bench-gpu: per-image times of a Qwen2-VL-2B-sized tower on the GPU, and the simulator's
# gains in those times for the default solver and the seed's.
GPU_PYTHON ?= python3
GPU_OUT ?= demo_output
GPU_RUN := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON)
gpu-check:
	$(GPU_RUN) -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_cuda_hf.py

bench-gpu:
	$(GPU_RUN) benchmarks/bench_gpu.py --out $(GPU_OUT)/gpu_timings.csv
	for solver in locality lpt; do \
		$(GPU_RUN) -m lightning_vit_balance.simulate examples/sample_visual_sizes.jsonl --progress never \
			--timings $(GPU_OUT)/gpu_timings.csv --ranks 8 64 512 --steps 300 --solver $$solver \
			--json $(GPU_OUT)/simulate_$$solver.json; \
	done

# The planner on other interpreters and NumPy releases (every rank plans alone, so all must plan
# alike): for each `interpreter:numpy-requirement` pair, a venv of NumPy alone, then the fixed corpus
# of tests/plan_corpus.py against the digests `make test` checks, natively and with an older x86 CPU's
# kernels (NumPy's baseline loops, OpenBLAS's Nehalem ones). An interpreter is a command or a
# path; one that does not run here is skipped, and none running at all is an error.
PLAN_VERSIONS ?= python3.10:numpy==1.24.4 python3.10:numpy==2.2.6 python3.12:numpy==1.26.4 \
	python3.12:numpy==2.0.2 python3.12:numpy==2.4.6 python3.13:numpy==2.5.5
plan-versions:
	@checked=0; for pair in $(PLAN_VERSIONS); do \
		python=$${pair%%:*}; numpy=$${pair#*:}; venv=.venv-plan-$${python##*/}-$${numpy#numpy==}; \
		if ! $$python -c "" 2> /dev/null; then echo "$$python: cannot run here, skipped"; continue; fi; \
		[ -x $$venv/bin/python ] || { $$python -m venv $$venv && $$venv/bin/pip install --quiet "$$numpy"; } \
			|| exit 1; \
		$$venv/bin/python tests/plan_corpus.py --planning-only || exit 1; \
		$$venv/bin/python tests/plan_corpus.py --planning-only --older-cpu || exit 1; \
		checked=$$((checked + 1)); \
	done; \
	if [ $$checked -eq 0 ]; then echo "no interpreter of PLAN_VERSIONS runs here: name them by path"; exit 1; fi

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .venv-transformers4 .venv-torch-oldest .venv-plan-* demo_output .pytest_cache .ruff_cache
