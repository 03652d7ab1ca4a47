# Two entry points: `make demo` (the main job, offline) and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: on CPU machines 2.13.0 is the CPU build; GPU users may preinstall their own.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Test-only extras: llama.cpp's OpenAI-compatible server (compiled from source, ~6 min once)
# and its GGUF converter, fetched here so that no test downloads anything.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,serve,llama,ray]"
	$(PY) -m tests.tools.tiny_gguf --fetch-converter-only
	touch $@

.PHONY: setup demo test lint
setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/speceyes demo

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check speceyes tests benchmarks
	$(PY) -m pytest -q --durations=15

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check speceyes tests benchmarks
