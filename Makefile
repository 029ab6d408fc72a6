# Each target builds its own virtualenv from scratch (Python 3.11 and nothing else needed).
PYTHON ?= python3
TEST_VENV := .venv-test
DEMO_VENV := .venv-demo
VERL_VENV := .venv-verl

.PHONY: demo test lint bench clean

$(TEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q -e ".[rl,trl,test,plots]"
	touch $@

$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q -e ".[rl,plots]"
	touch $@

## demo: install into .venv-demo and run the main job (a real distributed training run)
demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/conduit demo

$(VERL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --upgrade pip
	$(VERL_VENV)/bin/pip install -q -e ".[verl,test]"
	touch $@

## test: install into .venv-test, lint, and run the whole test suite; then tests/verl in
## .venv-verl (verl pins transformers < 5.11, which TRL's environment cannot share). The two
## environments install side by side (each pip is mostly one core waiting on unpacking).
## The suite runs on two pytest-xdist workers, a module at a time each, in collection order
## (tests/distributed first: each worker starts its three-node Ray cluster once); the Ray
## tests leave a core idle while their nodes answer, which the other worker uses.
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target $(TEST_VENV)/.installed $(VERL_VENV)/.installed
	$(TEST_VENV)/bin/ruff check src tests
	$(TEST_VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
	$(VERL_VENV)/bin/python -m pytest -q tests/verl

lint: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/ruff check src tests

## bench: the self-comparison benchmarks (not part of the tests)
bench: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/conduit bench plane

clean:
	rm -rf $(TEST_VENV) $(DEMO_VENV) $(VERL_VENV) runs .pytest_cache .ruff_cache

-include mk/peers.mk
