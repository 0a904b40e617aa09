# Two commands for a new user: `make demo` and `make test`. Both create and reuse .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LINTED := batchq producer consumer tests examples $(wildcard bench)

.PHONY: demo test lint typecheck check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[embedded,exporter,report,test,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/batchq demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy batchq producer consumer
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

bench: $(STAMP)
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/tutorial.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
