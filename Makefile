# `make demo` and `make test` work on a fresh machine: they create .venv and install first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean redis-server

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first when torch is absent: a plain `torch` requirement would pull CUDA wheels.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==2.13.0" || \
		$(BIN)/pip install "torch>=2.4" --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pagedkv demo

# redis-server for the Redis tier tests when missing (apt, as root or with passwordless sudo). Never fails:
# without it those tests skip, or fail under PAGEDKV_REQUIRE_REDIS=1 (.ci/run sets it).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -qq redis-server >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -qq >/dev/null 2>&1 && $$SUDO apt-get install -y -qq redis-server >/dev/null 2>&1; } || \
		echo "note: could not install redis-server; the Redis tier tests will skip"; }

test: $(STAMP) redis-server
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/pagedkv bench manager

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
