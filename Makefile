# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
# Each creates .venv and installs the project into it when needed: `make demo`
# only what the demo needs (the demo extra), `make test` the dev tools too.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# What is installed: the dev extra (tests, lint, docs; it includes the demo's
# needs), or only the demo's. A dev install marks the demo's stamp too.
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# Quiet TensorFlow's C++ logging in the tests (the keras-replicator commands,
# `make demo`'s included, quiet their own unless TF_CPP_MIN_LOG_LEVEL is set).
test: export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test lint docs install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev,datasets]"
	touch $(STAMP) $(DEMO_STAMP)

# The demo alone: TensorFlow, Keras and scikit-learn, not the dev tools.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	touch $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/keras-replicator demo --replicas 2

lint: $(STAMP)
	$(BIN)/ruff check keras_replicator tests examples benchmarks docs

# In-process tests run in TEST_JOBS pytest-xdist processes (a file's tests
# stay together); multi-worker tests start their own processes, one at a time.
TEST_JOBS ?= 2

# The documentation site, into site/. Strict: a broken link or anchor, or an
# API entry that does not resolve, fails the build. Runs offline. (Not
# --quiet: it hides the warnings that strict mode counts, so nothing fails.)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: $(STAMP) lint docs
	$(BIN)/pytest -q --timeout=600 --durations=25 -m "not multi_worker" -n $(TEST_JOBS) --dist loadfile
	# Exit code 5 means no multi-worker test was collected.
	$(BIN)/pytest -q --timeout=600 --durations=25 -m multi_worker || test $$? -eq 5

clean:
	rm -rf $(VENV) build *.egg-info site
