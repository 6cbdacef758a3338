# Shoal: `make run` serves a local Shoal, `make test` runs the suite, `make scenarios` the
# end-to-end scenarios (CI runs both).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed before the project, so the project's own `torch` requirement never pulls
# a build of its own, and a torch already in $(VENV) is kept. TORCH_INDEX_URL chooses the index
# it comes from (PyPI's Linux wheel is a CUDA build: https://download.pytorch.org/whl/cpu is
# the CPU one, the Dockerfile's default); empty, pip's own indexes. GPU users: install your
# CUDA torch into $(VENV) first, or set TORCH_INDEX_URL (and TORCH_SPEC) to it.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
STAMP := $(VENV)/.shoal-installed

.PHONY: run test scenarios lint typecheck unit screenshots clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/pip install --quiet $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/shoal up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The tests that need a GPU are skipped here: typed, they cannot call what no longer exists.
GPU_TESTS = $(shell grep -rl --include='*.py' 'mark.gpu' tests) tests/workers/sharp_memory.py

typecheck: $(STAMP)
	$(BIN)/mypy shoal
	$(BIN)/mypy $(GPU_TESTS)

unit: $(STAMP)
	$(BIN)/pytest -m unit -q

# Every test but the end-to-end scenarios: ~19 minutes on the 2-core dev machine.
test: lint typecheck
	$(BIN)/pytest -q --ignore=tests/integration

# The end-to-end scenarios (tests/integration, ~10 minutes on 2 cores): `shoal up` processes,
# most with local Ray clusters of several nodes of their own, faults injected into them; and
# uploaded code's checks in Ray workers under their limits.
scenarios: $(STAMP)
	$(BIN)/pytest -q tests/integration

# The README's and docs' dashboard pictures: the browser tests take them (needs chromium).
screenshots: $(STAMP)
	SHOAL_TEST_ARTIFACTS=build/test-artifacts SHOAL_REQUIRE_BROWSER=1 $(BIN)/pytest -q tests/dashboard
	mkdir -p docs/screenshots
	cp build/test-artifacts/dashboard/pages/*.png docs/screenshots/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
