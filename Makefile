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

.PHONY: demo test test-compat print-compat-next-pairs lint docs install clean

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

# Every test runs in one pool of TEST_JOBS pytest-xdist processes (a
# file's tests stay together, with their module-scoped runs). In-process
# tests keep a core busy; multi-worker tests mostly wait (for start-ups over
# loopback, timeouts and signals: one at a time they keep about half a core
# busy), so three processes on two cores fill the waits of one kind with the
# work of the other. Multi-worker tests start their workers from a zygote
# that imported TensorFlow once (tests/multi_worker/zygote.py).
TEST_JOBS ?= 3
# The compatibility runs are in-process tests only: a process per core.
COMPAT_JOBS ?= 2

# The documentation site, into site/. Strict: a broken link or anchor, or an
# API entry that does not resolve, fails the build. Runs offline. (Not
# --quiet: it hides the warnings that strict mode counts, so nothing fails.)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: $(STAMP) lint docs
	$(BIN)/pytest -q --timeout=600 --durations=25 -n $(TEST_JOBS) --dist loadfile

# The other supported TensorFlow releases, each with the oldest Keras it
# installs with, as TENSORFLOW/KERAS (`make test` runs the newest release
# pair, in .venv), and the next releases: TensorFlow's release candidate
# with the newest Keras release, and the newest TensorFlow with Keras'
# nightly build (KERAS `nightly`: the newest `keras-nightly` when the venv
# is made; `make clean` takes a newer one). Keep in step with
# keras_replicator/_src/core/versions.py.
COMPAT_OLDER_PAIRS := 2.19.1/3.10.0 2.20.0/3.12.0
COMPAT_NEXT_PAIRS := 2.22.0rc0/3.15.1 2.21.0/nightly
COMPAT_PAIRS := $(COMPAT_OLDER_PAIRS) $(COMPAT_NEXT_PAIRS)
# The core tests, and the ones of the version-specific code itself.
COMPAT_TESTS := tests/test_local_replicator.py tests/test_drop_in.py \
	tests/test_distribution.py tests/test_primitives.py tests/test_sharding.py \
	tests/test_patches.py tests/test_versions.py \
	tests/test_sharded_contraction.py
# What adds minutes to every pair and nothing version-specific runs in
# `make test` alone: test_patches' install-order sweep (about 250
# permutations), and the repeats of a case on more devices or in float64
# (each pair keeps such a case on 2 replicas, on the 2x2 mesh (the
# sharded products on 1x4), in float32, and in one 16-bit policy). 217
# tests, about 2:20 a pair on 2 cores.
COMPAT_DESELECT := -k "not test_any_install_order and not float64 \
	and not (16_bit and (mesh0 or mesh1)) \
	and not (test_row_matches_one_device and -4]) \
	and not (model_parallel_equals_one_device and 1x4)"
COMPAT_TEST_DEPS := "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5"

compat_tf = $(firstword $(subst /, ,$(1)))
compat_keras = $(lastword $(subst /, ,$(1)))
compat_nightly = $(filter nightly,$(call compat_keras,$(1)))
compat_venv = .venv-compat-tf$(basename $(call compat_tf,$(1)))$(if $(call compat_nightly,$(1)),-keras-nightly)
# The stamp names the pair: changing a pin above installs again.
compat_stamp = $(call compat_venv,$(1))/.installed-tf$(call compat_tf,$(1))-keras$(call compat_keras,$(1))

# One venv per pair, made once: the package as users install it (its own
# dependencies resolved by pip), the pair pinned, and the test runner.
# Two distributions install the `keras` module: `keras` and
# `keras-nightly`, which TensorFlow's release candidates require instead
# (and the package's `keras` requirement cannot be met by it). pip installs
# both into one directory, file over file, so after resolving the pair the
# rule removes both and installs the pair's Keras alone: `keras==KERAS`, or
# the newest `keras-nightly` (its dependencies are those of `keras`, already
# installed). TensorFlow's release candidates are on PyPI as `tensorflow`:
# the `==` pin installs them.
compat_keras_dist = $(if $(call compat_nightly,$(1)),--pre keras-nightly,keras==$(call compat_keras,$(1)))
define compat_venv_rule
$(call compat_stamp,$(1)): pyproject.toml
	test -x $(call compat_venv,$(1))/bin/python || $(PYTHON) -m venv $(call compat_venv,$(1))
	rm -f $(call compat_venv,$(1))/.installed-*
	$(call compat_venv,$(1))/bin/python -m pip install --quiet --disable-pip-version-check \
		-e . tensorflow==$(call compat_tf,$(1)) $(COMPAT_TEST_DEPS)
	$(call compat_venv,$(1))/bin/python -m pip uninstall --quiet -y keras keras-nightly
	$(call compat_venv,$(1))/bin/python -m pip install --quiet --disable-pip-version-check \
		$(call compat_keras_dist,$(1))
	touch $$@
endef
$(foreach pair,$(COMPAT_PAIRS),$(eval $(call compat_venv_rule,$(pair))))

# Every pair runs, then the target fails if any pair failed. Each pair's
# test command is one word of the loop: its venv's pytest, with its name.
compat_run = $(call compat_tf,$(1))/$(call compat_keras,$(1))=$(call compat_venv,$(1))
test-compat: $(foreach pair,$(COMPAT_PAIRS),$(call compat_stamp,$(pair)))
	@failed=""; for run in $(foreach pair,$(COMPAT_PAIRS),$(call compat_run,$(pair))); do \
		pair=$${run%%=*}; venv=$${run#*=}; \
		echo "== TensorFlow $${pair%/*} + Keras $${pair#*/} ($$venv, Keras" \
			"$$($$venv/bin/python -c 'import keras; print(keras.__version__)'))"; \
		$$venv/bin/pytest -q --timeout=600 -n $(COMPAT_JOBS) --dist loadfile \
			$(COMPAT_DESELECT) $(COMPAT_TESTS) || failed="$$failed $$pair"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-compat failed for:$$failed"; exit 1; fi

# For .ci/run, which checks that the index serves them.
print-compat-next-pairs:
	@echo $(COMPAT_NEXT_PAIRS)

clean:
	rm -rf $(VENV) .venv-compat-* build *.egg-info site
