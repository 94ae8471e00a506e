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

.PHONY: test-quick soak demo demo-django6 lock-demo bench bench-handoff bench-cpu bench-postgres bench-fenced bench-async bench-rates bench-console bench-beat bench-beat-peers faults test lint shape typecheck docs matrix matrix-envs pytest pytest-run coverage package services venv clean

demo: services $(STAMP)
	$(BIN)/python -m example_project.demo $(DEMO_ARGS)

# The demo on Python 3.13 with Django 6.1 (the matrix's environment, made by
# nox), where its django.tasks step runs too.
DJANGO6_SESSION := tests(python='3.13', django='6.1')
DJANGO6_PYTHON := .nox/tests-python-3-13-django-6-1/bin/python
demo-django6: services $(STAMP)
	$(BIN)/nox -s "$(DJANGO6_SESSION)" --install-only
	$(DJANGO6_PYTHON) -m example_project.demo $(DEMO_ARGS)

# The lock alone, and the cookbook recipe's failure after a flush or a restart.
lock-demo: services $(STAMP)
	$(BIN)/python scripts/lock_demo.py

# In four steps: the main run with the checks beside it (each part's output
# shown whole when it ends), then the making of the matrix's environments,
# then the matrix's tests, then the coverage they measured. The matrix's tests
# ran beside the main run once: on two cores the two took 1,840 s together and
# starved timing-bound tests (six failed in CI), where one after the other they
# take about 460 s and 270 s. The environments were made beside the main run
# too, at the lowest CPU priority (at full priority their bytecode compiling
# starved a beat's liveness thread): beside two CPU hogs that priority got
# them almost no CPU, and a fresh clone's four took over 25 minutes, where
# alone they take under one (uv's cache warm) to a few (cold).
# A failure in the first step still lets the matrix run: the last line says
# which of the two failed.
test: services $(STAMP)
	@main=passed; matrix=passed; \
	$(MAKE) --no-print-directory -k -j5 --output-sync=target pytest-run lint shape docs package || main=FAILED; \
	{ $(MAKE) --no-print-directory matrix-envs && $(MAKE) --no-print-directory matrix MATRIX_MODE=--installed; } || matrix=FAILED; \
	if [ $$matrix = passed ]; then $(MAKE) --no-print-directory coverage || matrix=FAILED; fi; \
	echo "make test: main run and checks $$main; matrix and coverage $$matrix"; \
	[ $$main = passed ] && [ $$matrix = passed ]

# The pre-commit hooks over every file: no large file, ruff, mypy, typos.
lint: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pre-commit run --all-files --show-diff-on-failure

# No class over 250 lines, no function over 50, no import circle nor layer
# broken in the package.
shape: $(STAMP)
	$(BIN)/python scripts/shape.py

# The documentation (Sphinx), warnings as errors; its examples run in the suite.
docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

typecheck: $(STAMP)
	$(BIN)/mypy django_tasklock

# In parallel (pytest-xdist: each worker process starts its own servers on free
# ports; a module's tests stay on one worker, so its shared Celery workers start
# once). Untraced: coverage is measured by the matrix's Python 3.13 run
# (noxfile.py), where it costs 8 % more CPU, not 44 % as here. Eight workers:
# most of a long module's time is waits (expiries, workers, servers), and with
# modules handed out longest first (tests/scheduling.py) the run took 361 s on
# eight and 413 s on six, with 1.7 and 1.4 of the two cores busy.
PYTEST_WORKERS ?= 8
# The modules the tests' processes import, compiled once before the run (for
# the same reason as the venv's: PYTHONDONTWRITEBYTECODE).
SOURCES := django_tasklock tests example_project benchmarks reliability
# Modules are handed out in the order tests/conftest.py gives them (long ones
# first: --no-loadscope-reorder), not xdist's largest-first, which left a long
# module of one test (a fault group) to start last and run on alone for minutes.
# The tests run in a random order (pytest-randomly), seeded by the commit: a
# new order for each commit, the same one for every run of a commit, so that a
# failure repeats. PYTEST_SEED=default draws a new order; the seed is printed.
PYTEST_SEED ?= $(or $(shell git rev-parse HEAD 2>/dev/null | cut -c1-8 | sed 's/^/0x/' | xargs -r printf '%d'),default)
pytest: pytest-run

# For development: the tests that take seconds, not minutes, in parallel: no
# module marked long (fault groups, benchmarks' smoke runs, worker storms) and
# no slow test (multi-process contention, expiry waits). make test runs them all.
test-quick: services $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not long and not slow" $(PYTEST_ARGS)

pytest-run: services $(STAMP)
	$(BIN)/python -m compileall -q -j0 $(SOURCES)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --randomly-seed=$(PYTEST_SEED) $(PYTEST_ARGS)

# The lines of django_tasklock the matrix's traced run (and the processes its
# tests started) ran; fail_under in pyproject.toml is the floor.
coverage: $(STAMP)
	rm -f .coverage
	$(BIN)/python -m coverage combine --keep .coverage-matrix/*
	$(BIN)/python -m coverage report --skip-covered

# sdist and wheel built, twine-checked, and the wheel used in a clean venv.
package: $(STAMP)
	./scripts/check-package $(BIN)/python

# The benchmark (see docs/explanation/performance.rst); BENCH_ARGS="--write-docs" updates it.
bench: services $(STAMP)
	$(BIN)/python -m benchmarks.bench $(BENCH_ARGS)

# Waiting in line: handoff, holds per process and requests per hold, beside
# polling and python-redis-lock (docs/howto/waiting.rst); BENCH_ARGS="--write-docs".
bench-handoff: services $(STAMP)
	$(BIN)/python -m benchmarks.handoff $(BENCH_ARGS)

# Client CPU per operation in instructions (valgrind's callgrind; see the docs,
# Performance); BENCH_ARGS="--write-docs" updates its table.
bench-cpu: services $(STAMP)
	$(BIN)/python -m benchmarks.cpu $(BENCH_ARGS)

# The PostgreSQL store's table after 100,000 lock cycles (size, dead rows),
# beside releases that delete (docs/explanation/performance.rst).
bench-postgres: services $(STAMP)
	$(BIN)/python -m benchmarks.postgres_bloat --compare $(BENCH_ARGS)

# Fenced writes: the same update with and without the fence condition, on
# PostgreSQL and SQLite (docs/explanation/performance.rst).
bench-fenced: services $(STAMP)
	$(BIN)/python -m benchmarks.fenced_writes $(BENCH_ARGS)

# Async locks: a cycle against the raw async floors and sync_to_async, and
# 1,000 coroutines in each of 5 processes (overlaps, the loop's lag).
bench-async: services $(STAMP)
	$(BIN)/python -m benchmarks.asyncio_locks $(BENCH_ARGS)

# Rate limits over real workers: exactness, lost calls, beside Celery's own
# (see docs/explanation/performance.rst); BENCH_ARGS="--write-docs" updates it.
bench-rates: services $(STAMP)
	$(BIN)/python -m benchmarks.rates $(BENCH_ARGS)

# The lock console with 100,000 held locks: page time and round trips (see
# docs/explanation/performance.rst); BENCH_ARGS="--write-docs" updates it.
bench-console: services $(STAMP)
	$(BIN)/python -m benchmarks.console $(BENCH_ARGS)

# Highly available Celery beat: three beats, the leader killed and paused, five
# minutes (see docs/howto/leader.rst); BENCH_ARGS="--cache redis" on Redis.
bench-beat: services $(STAMP)
	$(BIN)/python -m benchmarks.beat $(BENCH_ARGS)

# The same faults for LeaderScheduler, RedBeat and single-beat (from PyPI), one table.
bench-beat-peers: services $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[peers]"
	$(BIN)/python -m benchmarks.beat --peers $(BENCH_ARGS)

# Park and promote under load: 200 calls, 2 running, 50 parked, a pool
# process SIGKILLed mid-run (docs/howto/parking.rst, Measured).
bench-park: services $(STAMP)
	$(BIN)/python -m benchmarks.park $(BENCH_ARGS)

# The fault suite at full size (see README.rst, Reliability).
faults: services $(STAMP)
	$(BIN)/python -m reliability.faults $(FAULTS_ARGS)

# The randomized fault checker (reliability/checker.py) on every flavour, for
# SOAK_SECONDS each (15 minutes by default); SOAK_ARGS adds --seed, --clients...
SOAK_SECONDS ?= 900
soak: services $(STAMP)
	$(BIN)/python -m reliability.checker --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

# The other supported Python/Django pairs (the main run is python3 with Django
# 5.2), each in an environment of nox's (uv-made), side by side; see noxfile.py.
matrix: services $(STAMP)
	rm -rf .coverage-matrix
	$(BIN)/python scripts/matrix $(MATRIX_MODE) $(BIN)/nox $(NOX_ARGS)

# The matrix's environments alone (nox, one after another: each installs this
# checkout in editable mode, which writes into it; nothing else in make test
# builds in the checkout). make test makes them after its main run, not beside
# it (see there).
matrix-envs: $(STAMP)
	$(BIN)/python scripts/matrix --install-only $(BIN)/nox

services:
	@./scripts/ensure-services

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	# uv installs the rest: 18 s, where pip took 52 s. Compiled to bytecode
	# as pip does (uv does not by default): where PYTHONDONTWRITEBYTECODE is
	# set, as on CI's machine, every process the tests start compiled Django
	# and Celery anew (1.75 CPU-s to set up, not 0.76).
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .venv-3.* .nox build dist docs/_build *.egg-info .pytest_cache .mypy_cache .ruff_cache
