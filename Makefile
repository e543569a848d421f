# The two commands: `make serve` (the main job) and `make test` (the whole suite).
# Both set everything up first (scripts/setup.sh, idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup serve test bench

setup:
	@scripts/setup.sh

serve: setup
	$(VENV)/bin/tokenway serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

bench: setup
	$(PY) bench/engine_bench.py $(ARGS)
