# fleetgate developer commands. `make demo` and `make test` work on a fresh machine with python3 (>=3.11).
PY ?= python3
PORT ?= 8000
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow test-all test-stress test-chaos test-docker test-compose test-vllm lint \
        bench-overhead bench-sim clean

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

# The product's tests. Needs the Redis server at 127.0.0.1:6379 (db 15 is used), Prometheus, Chromium, kubectl and
# a few more: the preflight names every tool this lane needs, and how to get it, before any test runs.
# JOBS pytest processes (pytest-xdist; one per core of a 2-core machine); `make test JOBS=0` runs them in one.
JOBS ?= 2
test: install
	$(BIN)/python scripts/preflight.py test
	$(BIN)/pytest -q -n $(JOBS) --dist loadgroup -m "not study and not long"

# The second lane: the benchmark studies, the peers harness and the longest integration tests (the lists are in
# tests/conftest.py). `make test-all` runs both lanes in one pytest run.
test-slow: install
	$(BIN)/python scripts/preflight.py slow
	$(BIN)/pytest -q -m "study or long"

test-all: install
	$(BIN)/python scripts/preflight.py test slow
	$(BIN)/pytest -q

# The tests that assert on wall time or sample counts (scripts/timing_tests.txt), 10 runs in a row while two
# CPU-bound processes load both cores; every one must pass every run. `make test-stress RUNS=3` for fewer;
# `RECORD=bench/results/stress.md` appends the tally (command, commit, machine, load) to that file.
RUNS ?= 10
test-stress: install
	$(BIN)/python scripts/preflight.py test slow
	nice $(BIN)/python scripts/stress_tests.py --runs $(RUNS) -f scripts/timing_tests.txt $(if $(RECORD),--record $(RECORD))

# End to end against REAL vLLM (CPU build, tiny local model): creates or reuses the vLLM venv and the model
# (cached in ~/.cache/fleetgate, override with FLEETGATE_VLLM_VENV), then starts two servers and gateways.
test-vllm: install
	scripts/vllm_env.sh
	$(BIN)/python scripts/vllm_servers.py model
	$(BIN)/pytest tests_vllm -q

# Failure scenarios with real processes killed, frozen and flooded on purpose (tests_chaos/; results table in
# bench/results/chaos.md). Starts its own redis-server processes on free ports.
test-chaos: install
	$(BIN)/python scripts/preflight.py chaos
	$(BIN)/pytest tests_chaos -q

# Against the real Docker daemon (dockerd running; docker.io, docker-compose and busybox-static installed):
# the `docker` actuator scales a throwaway compose project. Leaves no container, network or volume behind.
test-docker: install
	$(BIN)/pytest tests_docker -q

# docker-compose.yml brought up for real as the project fleetgate-test (dockerd running; docker.io, docker-compose
# and debootstrap installed): stand-in images from Debian's packages (scripts/compose_images.sh; the debootstrap
# base is cached as an image), then the user-visible checks of tests_compose/. Ends with `down -v`.
# FLEETGATE_COMPOSE_RESULTS=bench/results also writes the autoscale timeline there (compose.md, compose.png).
test-compose: install
	$(BIN)/pytest tests_compose -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .

bench-overhead: install
	$(BIN)/python -m bench.overhead

bench-sim: install
	$(BIN)/python -m bench.sim_speed
	$(BIN)/python -m bench.sim_capacity

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
