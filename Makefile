# The two commands: `make serve` (the main job) and `make test` (the whole suite).
# Both set everything up first (scripts/setup.sh, idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
# The suite runs on this many pytest-xdist processes, a test file to one (module fixtures start
# their servers once); each has its own PostgreSQL and Redis (tests/conftest.py own_servers).
TEST_WORKERS ?= 2

.PHONY: setup serve test test-fast bench docs lint

setup:
	@scripts/setup.sh

serve: setup
	$(VENV)/bin/tokenway serve $(ARGS)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# The unit tests alone (no model, server process, Redis or PostgreSQL: tests/conftest.py marks
# the rest `heavy`): the loop while you edit, about a minute on 2 cores.
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not heavy" $(ARGS)

bench: setup
	$(PY) bench/engine_bench.py $(ARGS)

# Static checks, run by CI before the tests: ruff (style, imports, likely bugs) over the
# whole tree, the import layers (lint-imports, [tool.importlinter]: docs/design.md), then
# pyright (types) over the package ([tool.ruff], [tool.pyright]).
# IGNORE_WARNINGS: no check of PyPI for a newer pyright on every run.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright

# The documentation site (mkdocs.yml, docs/) into site/; any warning (a broken link) fails it.
docs: setup $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The docs extra (mkdocs-material), installed again only when pyproject.toml changes.
$(VENV)/.docs-installed: pyproject.toml
	$(PY) -m pip install --disable-pip-version-check -q -e '.[docs]'
	@touch $@
