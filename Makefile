# Two commands do everything on a fresh clone: `make demo` and `make test` (`make test-fast` skips slow tests).
# Both create .venv (with a ttnn-capable Python: 3.12 or 3.10) when it is missing.
# PYTHON=3.10 (or 3.12) picks the interpreter, e.g. `make test PYTHON=3.10 VENV=.venv310`.
# TESTS=subset runs the cross-Python subset (README, "Tests") instead of the whole suite.
# `make test-cards` runs the card suite (docs/cards.md) on DEVICE (default p150x2: cards, or ttsim when
# TT_METAL_SIMULATOR is set).
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Test files spread over 2 pytest-xdist workers (whole files per worker, so module fixtures are built once), handed
# out in collection order (tests/conftest.py puts the slowest files first; xdist's default reorders by test count,
# which left the slowest file to the end); XDIST= runs them in one process.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
TESTS ?= all
DEVICE ?= p150x2
CARDS_ARGS ?=
# Imports and runs the TT path once (device, layers, card suite at CI size with every probe), the CLI, the built
# wheel, and the transformers-dependent tests (parity, tokenizer): what can differ between Python versions.
SUBSET := tests/tt_ops/test_device.py tests/tt_ops/test_api_fidelity.py tests/tt/model/test_layers.py tests/commands/test_cards_check.py \
	tests/commands/test_demo.py tests/reference/test_hf_parity.py tests/test_config_checkpoint.py \
	tests/probes/test_records.py tests/tt/test_on_cards.py tests/test_packaging.py tests/test_chat_template.py
ifeq ($(TESTS),subset)
TEST_PATHS := $(SUBSET)
else ifeq ($(TESTS),all)
TEST_PATHS :=
else
$(error TESTS must be all or subset, got '$(TESTS)')
endif

.PHONY: install lock demo test test-fast test-cards clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml scripts/find_python.sh $(wildcard constraints/*.txt)
	@set -euo pipefail; \
	if [ ! -x "$(PY)" ]; then \
	  BASE=$$(bash scripts/find_python.sh $(PYTHON)); \
	  echo "[make] creating $(VENV) with $$BASE"; \
	  "$$BASE" -m venv $(VENV); \
	fi; \
	PV=$$($(PY) -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")'); \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -c constraints/py$$PV.txt -e '.[tt,test]'; \
	touch $(STAMP)

# Refresh constraints/pyXY.txt: resolve the project's dependencies afresh (no constraints) in a throwaway venv and
# write what pip chose. Commit the result once `make test` passes with it.
lock:
	@set -euo pipefail; \
	BASE=$$(bash scripts/find_python.sh $(PYTHON)); \
	TMP=$$(mktemp -d); trap 'rm -rf "$$TMP"' EXIT; \
	"$$BASE" -m venv "$$TMP/venv"; \
	"$$TMP/venv/bin/python" -m pip install -q --upgrade pip; \
	"$$TMP/venv/bin/python" -m pip install -q '.[tt,test]'; \
	PV=$$("$$TMP/venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")'); \
	{ echo "# Exact versions CI resolved for Python $${PV:0:1}.$${PV:1} (pip freeze of a fresh install); \`make install\` and .ci/run"; \
	  echo "# install with these as constraints. Refresh: \`make lock PYTHON=$${PV:0:1}.$${PV:1}\` (README, \"Reproducible installs\")."; \
	  "$$TMP/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^qwen36-tt'; } > constraints/py$$PV.txt; \
	echo "[make] wrote constraints/py$$PV.txt"

demo: $(STAMP)
	$(VENV)/bin/qwen36 demo
	$(VENV)/bin/qwen36 demo --device emulated-p150x2 --max-new-tokens 48

# Everything, cards-only tests skipped with a reason: what CI runs (.ci/run). The 25 slowest test phases are listed
# at the end, so the CI time budget can be watched from any run's log.
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25 $(PYTEST_ARGS) $(TEST_PATHS)

test-cards: $(STAMP)
	$(PY) -m qwen36.cli cards-check --device $(DEVICE) $(CARDS_ARGS)

# The inner loop while editing: every test not marked `slow` (pyproject.toml declares the marker).
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
