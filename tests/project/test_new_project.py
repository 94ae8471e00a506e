"""A new Django project, as a user starts one (``tests/newproject/``): it
installs the package from a wheel built from this checkout, in a virtual
environment of its own, and its three tests (a duplicate call joined, a run
refused while its lock is held, a rate-limited call admitted once the clock
moved) use the pytest plugin's ``tasklock`` fixture, which the wheel's entry
point enables with no line of the project's. They pass on memcached, on
Redis and on PostgreSQL alone (the project's database, migrated by the
project, holding its locks and Celery's results), eagerly and with a real
Celery worker. The same project with Django's tasks framework instead of
Celery (Django 6, django-tasks-db's database backend, no broker) passes its
own three on PostgreSQL alone, through that backend's worker."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

TEMPLATE = ROOT / "tests" / "newproject"

pytestmark = pytest.mark.slow


def _run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        command, capture_output=True, text=True, check=False, **kwargs
    )


def _checkout_copy(where: Path) -> Path:
    """The checkout's files (committed or not, but none git ignores), copied
    into ``where``: setuptools writes build/ and *.egg-info where it builds,
    and ``make matrix-envs`` installs the checkout into the matrix's
    environments, which write there too (beside this test, where a developer
    runs both)."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listing.split(b"\0")):
        source = ROOT / os.fsdecode(name)
        if source.is_file():  # (not one deleted since its last commit)
            target = where / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return where


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's wheel, built from this checkout."""
    where = tmp_path_factory.mktemp("dist")
    source = _checkout_copy(tmp_path_factory.mktemp("source"))
    build = [sys.executable, *shlex.split("-m build --no-isolation --wheel")]
    built = _run([*build, "--outdir", str(where), str(source)], timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = where.glob("*.whl")
    return found


def _new_project(
    where: Path, python: str, requirements: list[str]
) -> tuple[Path, Path]:
    """The project's directory (a copy of the template) in ``where``, and
    the Python of a virtual environment made there with ``requirements``."""
    venv = where / "venv"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        made = _run([uv, "venv", "--quiet", "--python", python, str(venv)])
        assert made.returncode == 0, made.stderr
        install = [
            uv,
            "pip",
            "install",
            "--quiet",
            # As pip does: the project's processes compile nothing at start
            # where PYTHONDONTWRITEBYTECODE is set.
            "--compile-bytecode",
            "--python",
            str(venv / "bin" / "python"),
        ]
    else:
        made = _run([python, "-m", "venv", str(venv)])
        assert made.returncode == 0, made.stderr
        install = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    installed = _run([*install, *requirements], timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    shutil.copytree(TEMPLATE, where / "project")
    return where / "project", venv / "bin" / "python"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> tuple[Path, Path]:
    """The Celery project: its directory and its Python, the wheel installed
    there (SQLAlchemy for Celery's database result backend)."""
    return _new_project(
        tmp_path_factory.mktemp("newproject"),
        sys.executable,
        [f"{wheel}[celery,redis,postgres]", "sqlalchemy", "pytest", "pytest-django"],
    )


def _django6_python() -> str:
    """A Python that Django 6 runs on (3.12 or later): on PATH, or pyenv's."""
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in ("3.13", "3.12"):
        found = [shutil.which(f"python{version}")]
        found += sorted(map(str, versions.glob(f"{version}.*/bin/python{version}")))
        for python in filter(None, found):
            if _run([python, "-c", ""]).returncode == 0:
                return python
    pytest.fail(
        "Django 6 needs Python 3.12 or later, and none was found (on PATH or in "
        "pyenv's versions): install python3.12 or python3.13"
    )


@pytest.fixture(scope="module")
def tasks_project(
    tmp_path_factory: pytest.TempPathFactory, wheel: Path
) -> tuple[Path, Path]:
    """The project with Django's tasks framework instead of Celery: Django 6
    and django-tasks-db, PostgreSQL its only server; no Celery installed, and
    the template's Celery files left out."""
    directory, python = _new_project(
        tmp_path_factory.mktemp("newproject-tasks"),
        _django6_python(),
        [
            f"{wheel}[postgres]",
            "Django>=6.0",
            "django-tasks-db",
            "pytest",
            "pytest-django",
        ],
    )
    for celery_only in ("proj/celery.py", "shop/tasks.py", "tests/test_tasks.py"):
        (directory / celery_only).unlink()
    (directory / "proj" / "__init__.py").write_text("")
    return directory, python


def _project_env(**values: str) -> dict[str, str]:
    """This process's environment, not its test settings, and ``values``."""
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTEST_", "DJANGO_"))
        },
        **values,
    }
    env.pop("PYTHONPATH", None)  # the installed wheel, not this checkout
    return env


def _migrated(directory: Path, python: Path, env: dict[str, str]) -> None:
    """``manage.py migrate``, then ``check``, as a new user runs them."""
    for command in (["migrate", "--no-input"], ["check"]):
        done = _run([str(python), "manage.py", *command], cwd=directory, env=env)
        assert done.returncode == 0, done.stdout + done.stderr


def _three_pass(directory: Path, python: Path, env: dict[str, str], tests: str) -> None:
    """The project's pytest on ``tests``: its three tests pass."""
    result = _run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", tests],
        cwd=directory,
        env=env,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "3 passed" in out, out


@pytest.fixture(scope="module")
def project_database(postgres, project) -> str:
    """A database of the project's own on the session's PostgreSQL, migrated
    by the project (the lock table made by django_tasklock's migration)."""
    postgres.execute("DROP DATABASE IF EXISTS newproject")
    postgres.execute("CREATE DATABASE newproject")
    store = f"postgres://{postgres.address}/newproject"
    _migrated(
        *project, _project_env(PROJ_LOCK_STORE=store, PROJ_BROKER="", PROJ_RESULTS="")
    )
    return store


@pytest.mark.parametrize("eager", ["1", "0"], ids=["eager", "worker"])
@pytest.mark.parametrize("store", ["memcached", "redis", "postgres"])
def test_a_new_projects_three_tests_pass(
    project, store, eager, memcached, redis_server, request
):
    directory, python = project
    base = redis_server.url.rsplit("/", 1)[0]
    locations = {"memcached": f"memcached://{memcached.address}", "redis": f"{base}/6"}
    results = f"{base}/8"
    if store == "postgres":
        # PostgreSQL its only store: the locks, and Celery's results too.
        locations["postgres"] = request.getfixturevalue("project_database")
        address = locations["postgres"].removeprefix("postgres://")
        results = f"db+postgresql+psycopg://tasklock@{address}"
    env = _project_env(
        PROJ_LOCK_STORE=locations[store],
        PROJ_BROKER=f"{base}/7",
        PROJ_RESULTS=results,
        PROJ_EAGER=eager,
    )
    _three_pass(directory, python, env, "tests/test_tasks.py")
    # The project runs the installed package (the plugin came with it: a
    # test asking for an unknown fixture errors).
    where = _run(
        [str(python), "-c", "import django_tasklock; print(django_tasklock.__file__)"],
        cwd=directory,
        env=env,
    )
    assert where.stdout.startswith(str(python.parent.parent)), where.stdout


def test_a_django_tasks_project_on_postgresql_alone(tasks_project, postgres):
    """Django's tasks framework with django-tasks-db's database backend and
    no broker at all: ``migrate`` and ``check`` pass, and the project's
    three tests (a duplicate joined, a run skipped while its lock is held,
    the lock a row of the project's database) pass through the backend's
    own worker, on the test database Django's test runner migrated."""
    directory, python = tasks_project
    postgres.execute("DROP DATABASE IF EXISTS newproject_tasks")
    postgres.execute("CREATE DATABASE newproject_tasks")
    env = _project_env(
        PROJ_LOCK_STORE=f"postgres://{postgres.address}/newproject_tasks",
        PROJ_TASKS="db",
    )
    _migrated(directory, python, env)
    _three_pass(directory, python, env, "tests/test_jobs.py")
