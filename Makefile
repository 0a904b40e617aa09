# Two commands for a new user: `make demo` and `make test`. Both create and reuse .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LINTED := batchq producer consumer tests examples $(wildcard bench)
# pytest-xdist workers of `make test`: most tests wait on processes they start, so two
# workers keep a 2-core machine busy (the suite takes about 5 minutes there, 8 serially).
PYTEST_WORKERS ?= 2

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
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

bench: $(STAMP)
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/tutorial.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
