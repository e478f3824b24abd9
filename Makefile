# Two commands for a newcomer: `make demo` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: install system-deps demo test test-fast proto clean

install: system-deps $(STAMP)

# Debian packages the scripts and tests use: redis-server (started privately when no Redis
# answers) and docker-compose 1.29 (validates docker-compose.yml). Installed when missing and we
# are root; otherwise say what to install.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian packages:$$missing"; \
	    (apt-get install -y -q $$missing >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null)) \
	      || echo "warning: could not install$$missing (tests that need them will say so)"; \
	  else echo "note: please install the Debian packages:$$missing"; fi; \
	fi

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
	$(PY) -m services.launch.demo

# Lint and import order first (configured in pyproject.toml [tool.ruff]): a violation fails the run.
test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=25 tests

test-fast: install
	$(PY) -m pytest -q -x tests/unit

clean:
	rm -rf $(VENV) .run build *.egg-info
