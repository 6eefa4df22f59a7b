# expertmesh — the two set-up commands are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
REDIS_PORT ?= 6399
RUN_DIR := .run

.PHONY: install proto run test redis-start redis-stop clean

# A pinned CPU torch first: an unpinned one pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed proto

proto: $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=services --grpc_python_out=services \
		--pyi_out=services protos/expertmesh/v1/*.proto

# The embedded platform with its orchestrator (live migrations, drift with ARGS=--drift) and the
# OpenAI-compatible HTTP API on :8000; ARGS adds flags of `expertmesh up`.
run: install
	$(VENV)/bin/expertmesh up --orchestrator --http-port 8000 $(ARGS)

redis-start:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@mkdir -p $(RUN_DIR)
	@redis-server --bind 127.0.0.1 --port $(REDIS_PORT) --save '' --appendonly no --databases 64 \
		--daemonize yes --pidfile $(abspath $(RUN_DIR))/redis.pid --logfile $(abspath $(RUN_DIR))/redis.log
	@for i in $$(seq 50); do redis-cli -p $(REDIS_PORT) ping >/dev/null 2>&1 && break; sleep 0.1; done

redis-stop:
	@test -f $(RUN_DIR)/redis.pid && kill $$(cat $(RUN_DIR)/redis.pid) 2>/dev/null; rm -f $(RUN_DIR)/redis.pid; true

test: install
	$(MAKE) redis-start
	EXPERTMESH_TEST_REDIS_URL=redis://127.0.0.1:$(REDIS_PORT)/0 HF_HUB_OFFLINE=1 \
		$(PY) -m pytest -q $(PYTEST_ARGS); status=$$?; $(MAKE) redis-stop; exit $$status

clean:
	rm -rf $(VENV) $(RUN_DIR) services/expertmesh/v1 .pytest_cache
