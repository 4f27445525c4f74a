# The README's commands. `make demo` runs the multi-rank balanced training demo;
# `make test` runs the whole test suite; `make bench` prints the planning benchmark.
PYTHON ?= python3
VENV ?= .venv
TORCH_REQUIREMENTS ?= requirements/torch-cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench lint clean

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

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) demo_output .pytest_cache .ruff_cache
