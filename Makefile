# `make demo` and `make test` work on a fresh machine: they create .venv and install first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

PEERS_VENV := .venv-peers
PEERS_BIN := $(PEERS_VENV)/bin
PEERS_STAMP := $(PEERS_VENV)/.installed

MAX_VENV := .venv-max
MAX_BIN := $(MAX_VENV)/bin
MAX_STAMP := $(MAX_VENV)/.installed

.PHONY: demo test bench lint clean redis-server peers test-peers

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

# tests/peers run in .venv-peers (`make test-peers`); under PAGEDKV_REQUIRE_PEERS=1 `make test` runs them too.
test: $(STAMP) redis-server
	$(BIN)/python -m pytest --ignore=tests/peers
	if [ "$$PAGEDKV_REQUIRE_PEERS" = 1 ]; then $(MAKE) test-peers; fi

# Real vLLM 0.33.0 and SGLang 0.5.23 cache managers as benchmark peers, in their own venv (CPU only).
# CPU torch first, then the merged pins with --no-deps (their own torch pins would pull CUDA builds);
# pagedkv itself with --no-deps too, so `.[dev]` cannot move transformers off the pinned 5.20.2.
$(PEERS_STAMP): requirements/peers-cpu.txt pyproject.toml
	test -x $(PEERS_BIN)/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/pip install "torch==2.13.0+cpu" || \
		$(PEERS_BIN)/pip install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
	$(PEERS_BIN)/pip install --no-deps -r requirements/peers-cpu.txt
	$(PEERS_BIN)/pip install --no-deps -e .
	$(PEERS_BIN)/pip install numpy xxhash hypothesis pytest matplotlib redis einops
	$(PEERS_BIN)/python -c "import torch, transformers; assert torch.__version__ == '2.13.0+cpu', torch.__version__; assert transformers.__version__ == '5.20.2', transformers.__version__"
	touch $(PEERS_STAMP)

# Modular MAX 26.3.0 (the release that matches MAX's documented API) in its own venv: its pinned CPU
# requirements (no torch), then CPU torch and pagedkv (--no-deps) for the differential test.
$(MAX_STAMP): requirements/max-cpu.txt pyproject.toml
	test -x $(MAX_BIN)/python || $(PYTHON) -m venv $(MAX_VENV)
	$(MAX_BIN)/pip install -r requirements/max-cpu.txt
	$(MAX_BIN)/pip install "torch==2.13.0" || \
		$(MAX_BIN)/pip install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
	$(MAX_BIN)/pip install --no-deps -e .
	$(MAX_BIN)/pip install xxhash hypothesis pytest
	$(MAX_BIN)/python -c "import max.kv_cache, torch, pagedkv"
	touch $(MAX_STAMP)

peers: $(PEERS_STAMP) $(MAX_STAMP)

test-peers: $(PEERS_STAMP) $(MAX_STAMP)
	PAGEDKV_REQUIRE_PEERS=1 $(PEERS_BIN)/python -m pytest tests/peers -q --ignore=tests/peers/test_max_differential.py
	PAGEDKV_REQUIRE_PEERS=1 $(MAX_BIN)/python -m pytest tests/peers/test_max_differential.py -q

bench: $(STAMP)
	$(BIN)/pagedkv bench manager

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(MAX_VENV) build src/*.egg-info .pytest_cache
