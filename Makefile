# `make test` and `make demo` work on a fresh machine: each installs what it needs first.
PYTHON ?= python3
# On these machines pip takes this release's CPU build from local disk; an unpinned torch would pull
# a multi-GB CUDA build. Elsewhere choose your build: make test TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0

.PHONY: install openenv-venv test demo

# bubblewrap is the jail for model-written code (the code_exec scorer); `keel doctor` says what holds without it.
install:
	@command -v bwrap >/dev/null || { export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq bubblewrap libseccomp2 \
	  || { apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2; } \
	  || echo "keel: could not install bubblewrap (apt-get install bubblewrap); code_exec runs without its jail"; }
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test,tracking,verifiers]"

# OpenEnv 0.10 and verifiers 0.4 cannot share one environment: verifiers pins mcp==2.0.0 and OpenEnv's
# client imports fastmcp 3, which needs mcp<2. OpenEnv goes into a venv layered over this one: a .pth
# adds this environment's packages after the venv's own, so its mcp and fastmcp shadow these while
# torch and keel are shared (seconds, not a second copy of torch). verifiers' classic API (<0.4, which
# keel still runs where it is installed) shares mcp<2 with OpenEnv, so it goes there too. The tests of
# both run under it; none is skipped in either environment.
OPENENV_VENV ?= .venv-openenv
OPENENV_TESTS = tests/unit/test_openenv*.py tests/integration/test_openenv*.py \
	tests/integration/test_verifiers_classic.py

openenv-venv: install
	test -x $(OPENENV_VENV)/bin/python || $(PYTHON) -m venv --without-pip $(OPENENV_VENV)
	$(PYTHON) -c "import sysconfig; paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ('purelib', 'platlib')); print(''.join(f'import site; site.addsitedir({p!r})\n' for p in paths), end='')" \
	  > "$$($(OPENENV_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/keel-main-environment.pth"
	$(PYTHON) -m pip --python $(OPENENV_VENV)/bin/python install -q -e ".[openenv]" "verifiers>=0.3,<0.4"

# verl without its dependencies: tests compare keel with verl's own reward, tool and config code
# (tests/verl_shim.py imports those modules without Ray or torch extras).
VERL ?= verl==0.9.1

# Lint and format are checked first: they take seconds, the tests minutes.
PY_DIRS = keel tests benchmarks examples

test: install openenv-venv
	$(PYTHON) -m pip install -q --no-deps "$(VERL)"
	$(PYTHON) -m ruff check $(PY_DIRS)
	$(PYTHON) -m ruff format --check $(PY_DIRS)
	$(PYTHON) -m pytest -q tests --ignore-glob='*/test_openenv*.py' --ignore-glob='*/test_verifiers_classic.py'
	$(OPENENV_VENV)/bin/python -m pytest -q $(OPENENV_TESTS)

# SFT then GRPO on a tiny model that learns addition: minutes on 2 CPU cores (the README says how many
# where). `make demo DEMO_FLAGS=--smoke`: a few steps of each stage, to check a setup.
demo: install
	$(PYTHON) -m keel demo $(DEMO_FLAGS)
