# Every target sets itself up from nothing but Python 3.11 and the package registries.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_DIR := $(CURDIR)/run

.PHONY: run demo test proto bench replay soak clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) on PATH (or PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

run: $(STAMP) ## start kvd in the foreground on the embedded default (host memory, unix socket)
	@mkdir -p $(RUN_DIR)
	$(BIN)/python -m kvd_loadgen.showcase --socket $(RUN_DIR)/kvd.sock

demo: $(STAMP) ## in another terminal: create memory pressure against a running kvd and show what happened
	$(BIN)/kvd-loadgen demo --target unix://$(RUN_DIR)/kvd.sock

test: $(STAMP) ## the whole test suite
	$(BIN)/python -m pytest -q

proto: $(STAMP) ## regenerate proto/kvd_api from proto/kvd_api/v1/kvd.proto
	$(BIN)/python -m kvd_api.generate

bench: $(STAMP) ## benchmarks: figures printed and written to bench/results.json
	$(BIN)/kvd-loadgen bench --json bench/results.json

replay: $(STAMP) ## the five intent-trace profiles under every policy, through a live kvd
	$(BIN)/kvd-loadgen replay-intents all --policy all --json bench/replay.json

soak: $(STAMP) ## 64 clients, mixed workload, 3 minutes: RSS, leaks, latency per period; then the state machine and the concurrent engines at length
	$(BIN)/kvd-loadgen soak --clients 64 --duration-s 180 --json bench/soak.json
	KVD_MACHINE_EXAMPLES=300 KVD_MACHINE_STEPS=80 $(BIN)/python -m pytest -q tests/integration/test_daemon_machine.py
	KVD_CHAOS_STEPS=2000 KVD_CHAOS_POLICIES=all $(BIN)/python -m pytest -q tests/integration/test_chaos.py

clean:
	rm -rf $(VENV) $(RUN_DIR) .pytest_cache
