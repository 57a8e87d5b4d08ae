# `make test` and `make demo` work on a fresh machine: each installs what it needs first.
PYTHON ?= python3
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install test demo

install:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test]"

test: install
	$(PYTHON) -m pytest -q tests

# Until the embedded demo lands: the quick-start example, GRPO on a tiny model (~1 minute on CPU).
demo: install
	$(PYTHON) examples/quickstart/prepare.py examples/data
	$(PYTHON) -m keel train examples/quickstart/grpo.yaml
