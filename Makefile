# Two commands do everything on a fresh clone: `make demo` and `make test` (`make test-fast` skips slow tests).
# Both create .venv (with a ttnn-capable Python: 3.12 or 3.10) when it is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install demo test test-fast clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml scripts/find_python.sh
	@set -euo pipefail; \
	if [ ! -x "$(PY)" ]; then \
	  BASE=$$(bash scripts/find_python.sh); \
	  echo "[make] creating $(VENV) with $$BASE"; \
	  "$$BASE" -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -e '.[tt,test]'; \
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qwen36 demo
	$(VENV)/bin/qwen36 demo --device emulated-p150x2 --max-new-tokens 48

# Everything, cards-only tests skipped with a reason: what CI runs (.ci/run).
test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The inner loop while editing: every test not marked `slow` (pyproject.toml declares the marker).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
