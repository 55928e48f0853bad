# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv/ (Python 3.11) when missing and install the project with one command
# (infra/install.py: uv with pip's settings, pip where uv cannot be had); the install is skipped
# while its stamp in .venv/ is newer than pyproject.toml, the Makefile and infra/install.py.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.installed-demo-stamp

# Ray on one machine: bind to 127.0.0.1 and no token auth.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled

.PHONY: demo core-demo test install install-demo bytecode clean-venv fresh-demo-install

install: $(STAMP)

$(STAMP): pyproject.toml Makefile infra/install.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) infra/install.py '.[dev,bench,timm]'
	@touch $(STAMP)

# `make demo` needs the base alone, not the test tools or the bench peers (a full install serves it too).
install-demo: $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml Makefile infra/install.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test $(STAMP) -nt pyproject.toml -a $(STAMP) -nt Makefile -a $(STAMP) -nt infra/install.py || $(PY) infra/install.py .
	@touch $(DEMO_STAMP)

# The project's own modules compiled once (only what changed): every Ray worker process imports
# them, and where PYTHONDONTWRITEBYTECODE is set (as in many containers) none writes its .pyc, so
# each would compile them again (0.1-0.4 CPU-s a process; a smoke job starts ~35).
bytecode:
	@$(PY) -m compileall -q -j 0 pipelines laplace_core jobs benchmarks tests > /dev/null

# The embedded default: the Ray job on a local Ray instance with the bundled demo data.
demo: $(DEMO_STAMP) bytecode
	$(PY) jobs/imagenet_inf.py

# The core alone (no Ray): statistics, every posterior, samples and sizes on the demo data.
core-demo: $(STAMP)
	$(PY) jobs/core_demo.py

# pytest exits 5 when it collects no tests; make then fails, as it should.
# INFOFORM_FRESH_DEMO=1: also clone this checkout, `make demo` in it with a new venv and check
# the report (tests/jobs/test_demo_fresh.py, a few minutes); INFOFORM_FRESH_DEMO=0 skips it.
INFOFORM_FRESH_DEMO ?= 1
export INFOFORM_FRESH_DEMO
# Its clone and `make install-demo` start here, in the background, beside this checkout's own
# install (one install process: a core idle otherwise); the test runs `make demo` in the clone.
FRESH_DEMO_DIR := /tmp/infoform-fresh-demo-$(shell printf %s "$(CURDIR)" | cksum | cut -d" " -f1)

test: fresh-demo-install $(STAMP) bytecode
	INFOFORM_FRESH_DEMO_DIR=$(FRESH_DEMO_DIR) $(PY) -m pytest -q

fresh-demo-install:
	@if [ "$$INFOFORM_FRESH_DEMO" = 1 ]; then ($(PYTHON) tests/fresh_clone.py $(FRESH_DEMO_DIR) > /dev/null 2>&1 &); fi

clean-venv:
	rm -rf $(VENV)
