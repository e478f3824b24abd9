# Two commands for a newcomer: `make demo` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast kernels-test proto clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	# The pinned CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# NIXL's wheel depends on a CUDA torch and both CUDA flavours: take the cu12 build alone.
	$(PIP) install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(PY) -m proto.build
	touch $(STAMP)

proto: install
	$(PY) -m proto.build

demo: install
	$(PY) -m services.demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

test-fast: install
	$(PY) -m pytest -q -x tests/unit

clean:
	rm -rf $(VENV) .run build *.egg-info
