# fleetgate developer commands. `make demo` and `make test` work on a fresh machine with python3 (>=3.11).
PY ?= python3
PORT ?= 8000
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-chaos lint bench-overhead bench-sim clean test-vllm

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Gateway in front of 4 simulated vLLM workers, in-memory state: no Redis, Docker or GPU needed.
# `make demo PORT=9000`: the gateway on 9000, the workers on 9001-9004.
demo: install
	$(BIN)/fleetgate demo --workers 4 --port $(PORT)

# The whole test suite. Needs the Redis server at 127.0.0.1:6379 (db 15 is used); the preflight says how to start one.
test: install
	$(BIN)/python scripts/preflight.py
	$(BIN)/pytest -q

# End to end against REAL vLLM (CPU build, tiny local model): creates or reuses the vLLM venv and the model
# (cached in ~/.cache/fleetgate, override with FLEETGATE_VLLM_VENV), then starts two servers and gateways.
test-vllm: install
	scripts/vllm_env.sh
	$(BIN)/python scripts/vllm_servers.py model
	$(BIN)/pytest tests_vllm -q

# Failure scenarios with real processes killed, frozen and flooded on purpose (tests_chaos/; results table in
# bench/results/chaos.md). Starts its own redis-server processes on free ports.
test-chaos: install
	$(BIN)/pytest tests_chaos -q

lint: install
	$(BIN)/ruff check .

bench-overhead: install
	$(BIN)/python -m bench.overhead

bench-sim: install
	$(BIN)/python -m bench.sim_speed
	$(BIN)/python -m bench.sim_capacity

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
