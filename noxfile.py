"""The other supported Python/Django pairs, each in an environment of its own.

``make test`` runs these (``scripts/matrix``: side by side) after the main
run (python3, Django 5.2) and its checks; ``nox -s
"tests(python='3.13', django='6.1')"`` runs one.
Environments are made with uv when it is installed (``make venv`` installs it),
and kept between runs. A pair whose Python is missing fails the run.

The pairs run the suite without its ``slow`` tests: those (many processes
fighting for locks, expiry waits, worker kills, the fault and benchmark smoke
runs) measure the lock against the store and the operating system, which do not
change with the Python or Django version; every code path they take is run by
quicker tests here as well. Their store tests run on the stores ``STORES``
names for each pair (below). The main run has them all.

Coverage is measured here, on the newest pair (``COVERED``), not in the main
run: Python 3.13's ``sys.monitoring`` core (``COVERAGE_CORE=sysmon``) costs
that run about 8 % more CPU, where coverage's C tracer cost the main run (Python
3.11) 44 % (1,064 CPU-s untraced, 1,535 traced, measured in one session).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests", "oldest"]

ROOT = Path(__file__).resolve().parent
#: (Python, Django): every supported Django release once. The oldest pair;
#: Django 6.0 on the oldest Python it takes; the newest of all, 6.1 on 3.13
#: (the main run is python3, 3.11, with Django 5.2).
PAIRS = [("3.10", "5.2"), ("3.12", "6.0"), ("3.13", "6.1")]
#: The stores each pair's store tests run on: those whose client code changes
#: with the Python or Django version. Django's own (``PyMemcacheCache``,
#: ``RedisCache``) on each Django 6 release (the main run has Django 5.2's);
#: the third-party clients (django-redis; pylibmc, a C extension) on the
#: oldest Python (the main run has them on 3.11; every pair installs them and
#: runs their own tests, in test_django_redis.py and test_slab_moves.py). The memcached classic
#: protocol and the Redis Cluster are this package's code and the servers',
#: run on every store by the main run; ``tests/backends/redis/test_cluster.py`` runs here too,
#: on django-valkey. Every store on every pair was 30 % more tests here, paid
#: for by the time ``make test`` takes; two stores each keep the sessions,
#: which run side by side, of one length.
STORES = {
    ("3.10", "5.2"): "django-redis,pylibmc",
    ("3.12", "6.0"): "memcached-meta,redis",
    ("3.13", "6.1"): "",  # every store: its coverage is the suite's
}
#: The pair whose run is traced (every store, and the processes its tests
#: start), its coverage the one ``make coverage`` reports: line coverage, as
#: the ``sysmon`` core measures it before Python 3.14 (pyproject.toml).
COVERED = PAIRS[-1]
#: Its xdist workers: it runs the most tests of the three, side by side.
COVERED_WORKERS = "3"
#: The modules the tests' processes import, compiled once before a run.
SOURCES = ["django_tasklock", "tests", "example_project", "benchmarks", "reliability"]


def _interpreters_on_path() -> None:
    """Put a ``python3.X`` that runs on PATH for each pair: pyenv's shims name
    versions that are not selected, and fail when run; its versions' own
    binaries do not."""
    links = Path(tempfile.mkdtemp(prefix="tasklock-nox-"))
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for python, _django in PAIRS:
        name = f"python{python}"
        found = shutil.which(name)
        if (
            found
            and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0
        ):
            continue
        for candidate in sorted(versions.glob(f"{python}.*/bin/{name}"), reverse=True):
            (links / name).symlink_to(candidate)
            break
    os.environ["PATH"] = f"{links}{os.pathsep}{os.environ.get('PATH', '')}"


_interpreters_on_path()

# nox finds each pair's interpreter by running it (python-discovery), and gives
# up on one that has not answered within 15 s by default. The matrix's
# environments are made beside the main run at the lowest CPU priority (make
# matrix-envs): a fresh clone's run failed there once, "Python interpreter
# 3.10 not found" after two minutes, with the load average at 11-12; nox then
# tried to download a Python, which this machine cannot.
os.environ.setdefault("PY_DISCOVERY_TIMEOUT", "600")


def _commit_seed() -> int:
    """The first 32 bits of the commit checked out; a random seed outside a
    git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout
        return int(head[:8], 16)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return random.randrange(2**32)


@nox.session
@nox.parametrize("python,django", PAIRS)
def tests(session: nox.Session, django: str) -> None:
    """The suite but its slow tests; on the ``COVERED`` pair, traced."""
    # Compiled to bytecode (uv does not by default): where
    # PYTHONDONTWRITEBYTECODE is set, every process the tests start compiled
    # Django and Celery anew otherwise (Makefile, $(STAMP)).
    session.install(
        "-e", ".[test]", f"Django~={django}", env={"UV_COMPILE_BYTECODE": "1"}
    )
    session.run("python", "-m", "compileall", "-q", "-j0", *SOURCES)
    coverage = ROOT / ".coverage-matrix"
    coverage.mkdir(exist_ok=True)
    measured = (session.python, django) == COVERED and not session.posargs
    # A random order (pytest-randomly) seeded by the commit, as in make test:
    # said here, since -q hides the header that would name it.
    seed = _commit_seed()
    session.log(f"tests in random order: --randomly-seed={seed} repeats it")
    pytest = ["python", "-m", "pytest", "-q", f"--randomly-seed={seed}"]
    pytest += ["-p", "no:cacheprovider"]
    env = {
        "COVERAGE_FILE": str(coverage / f"{session.python}"),
        "TASKLOCK_TEST_STORES": os.environ.get(
            "TASKLOCK_TEST_STORES", STORES[str(session.python), django]
        ),
    }
    if measured:
        env["COVERAGE_CORE"] = "sysmon"
    workers = COVERED_WORKERS if measured else "2"
    session.run(
        *pytest,
        "-m",
        "not slow",
        "-n",
        os.environ.get("TASKLOCK_MATRIX_WORKERS", workers),
        # A module's tests on one worker, as in the main run: the docs'
        # examples build on the ones above them, and a module's shared
        # servers and workers start once.
        "--dist",
        "loadfile",
        *(["--cov", "--cov-report=", "--cov-fail-under=0"] if measured else []),
        *session.posargs,
        env=env,
    )


@nox.session(python=PAIRS[0][0])
def oldest(session: nox.Session) -> None:
    """What ``django_tasklock.foreign`` reads of other packages, on the oldest
    releases setup.cfg allows (uv's lowest-direct resolution: Django 5.2.0,
    Celery 5.3.0, redis-py 4.5.0, django-redis 5.4.0, django-valkey 0.4.0,
    pymemcache 4.0.0, pylibmc 1.6.0); the matrix's other sessions have the
    newest. Without the suite's conftest: its helpers need newer clients."""
    session.install(
        "--resolution",
        "lowest-direct",
        "-e",
        ".[test]",
        f"Django~={PAIRS[0][1]}",
        env={"UV_COMPILE_BYTECODE": "1"},
    )
    pytest = ["python", "-m", "pytest", "-q", "-p", "no:randomly"]
    pytest += ["-p", "no:cacheprovider", "--noconftest"]
    session.run(*pytest, "tests/project/test_foreign.py", *session.posargs)
