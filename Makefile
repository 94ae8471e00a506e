# The two commands a newcomer runs (see README.rst):
#   make demo   the main job: the example project's feed importer under a storm of
#               duplicate tasks, over real Celery worker processes
#   make test   the whole suite: lint, types and tests against real services
# Both set up everything themselves: the memcached/redis-server binaries (apt-get,
# when missing and run as root), a virtual environment in .venv, and the package.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo lock-demo bench bench-cpu faults test lint typecheck matrix pytest package services venv clean

demo: services $(STAMP)
	$(BIN)/python -m example_project.demo $(DEMO_ARGS)

# The lock alone, and the cookbook recipe's failure after a flush or a restart.
lock-demo: services $(STAMP)
	$(BIN)/python scripts/lock_demo.py

test: services $(STAMP) lint typecheck package matrix pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy django_tasklock

# With branch coverage of django_tasklock, in the worker processes the tests
# start as well, combined with the matrix runs' (code only Django 6 runs is
# measured there); fail_under in pyproject.toml is the floor.
pytest: services $(STAMP)
	$(BIN)/python -m pytest --cov --cov-report= --cov-fail-under=0 $(PYTEST_ARGS)
	if ls .coverage-matrix/* >/dev/null 2>&1; then \
		$(BIN)/python -m coverage combine --append --keep .coverage-matrix/*; fi
	$(BIN)/python -m coverage report --skip-covered

# sdist and wheel built, twine-checked, and the wheel used in a clean venv.
package: $(STAMP)
	./scripts/check-package $(BIN)/python

# The benchmark (see README.rst, Performance); BENCH_ARGS="--write-readme" updates it.
bench: services $(STAMP)
	$(BIN)/python -m benchmarks.bench $(BENCH_ARGS)

# Client CPU per operation in instructions (valgrind's callgrind; see README.rst,
# Performance); BENCH_ARGS="--write-readme" updates its table.
bench-cpu: services $(STAMP)
	$(BIN)/python -m benchmarks.cpu $(BENCH_ARGS)

# The fault suite at full size (see README.rst, Reliability).
faults: services $(STAMP)
	$(BIN)/python -m reliability.faults $(FAULTS_ARGS)

# The other supported Python/Django pairs (the main run is python3 with Django 5.2).
matrix: services
	./scripts/matrix

services:
	@./scripts/ensure-services

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .venv-3.* build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
