# `make test` and `make demo` work on a fresh machine: each installs what it needs first.
PYTHON ?= python3
# On these machines pip takes this release's CPU build from local disk; an unpinned torch would pull
# a multi-GB CUDA build. Elsewhere choose your build: make test TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0

.PHONY: install test demo

# bubblewrap is the jail for model-written code (the code_exec scorer); `keel doctor` says what holds without it.
install:
	@command -v bwrap >/dev/null || { export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq bubblewrap libseccomp2 \
	  || { apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2; } \
	  || echo "keel: could not install bubblewrap (apt-get install bubblewrap); code_exec runs without its jail"; }
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test,tracking,verifiers,openenv]"

# verl without its dependencies: tests compare keel with verl's own reward, tool and config code
# (tests/verl_shim.py imports those modules without Ray or torch extras).
VERL ?= verl==0.9.1

# Lint and format are checked first: they take seconds, the tests minutes.
PY_DIRS = keel tests benchmarks examples

test: install
	$(PYTHON) -m pip install -q --no-deps "$(VERL)"
	$(PYTHON) -m ruff check $(PY_DIRS)
	$(PYTHON) -m ruff format --check $(PY_DIRS)
	$(PYTHON) -m pytest -q tests

# SFT then GRPO on a tiny model that learns addition: minutes on 2 CPU cores (the README says how many
# where). `make demo DEMO_FLAGS=--smoke`: a few steps of each stage, to check a setup.
demo: install
	$(PYTHON) -m keel demo $(DEMO_FLAGS)
