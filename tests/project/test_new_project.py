"""A new Django project, as a user starts one (``tests/newproject/``): it
installs the package from a wheel built from this checkout, in a virtual
environment of its own, and its three tests (a duplicate call joined, a run
refused while its lock is held, a rate-limited call admitted once the clock
moved) use the pytest plugin's ``tasklock`` fixture, which the wheel's entry
point enables with no line of the project's. They pass on memcached, on
Redis and on PostgreSQL alone (the project's database holding its locks),
eagerly and with a real Celery worker."""

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
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The project's directory and its Python, the wheel installed there."""
    where = tmp_path_factory.mktemp("newproject")
    source = _checkout_copy(tmp_path_factory.mktemp("source"))
    build = [sys.executable, *shlex.split("-m build --no-isolation --wheel")]
    built = _run(
        [*build, "--outdir", str(where / "dist"), str(source)],
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (where / "dist").glob("*.whl")
    venv = where / "venv"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        made = _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
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
        made = _run([sys.executable, "-m", "venv", str(venv)])
        assert made.returncode == 0, made.stderr
        install = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    installed = _run(
        [*install, f"{wheel}[celery,redis,postgres]", "pytest", "pytest-django"],
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    shutil.copytree(TEMPLATE, where / "project")
    return where / "project", venv / "bin" / "python"


@pytest.fixture(scope="module")
def project_database(postgres) -> str:
    """A database of the project's own on the session's PostgreSQL, its lock
    table made as ``migrate`` makes it (the project's tests use no database
    of Django's test runner)."""
    import psycopg

    from django_tasklock.backends.postgres.statements import CREATE

    postgres.execute("DROP DATABASE IF EXISTS newproject")
    postgres.execute("CREATE DATABASE newproject")
    with psycopg.connect(postgres.dsn("newproject"), autocommit=True) as conn:
        conn.execute(CREATE)
    return f"postgres://{postgres.address}/newproject"


@pytest.mark.parametrize("eager", ["1", "0"], ids=["eager", "worker"])
@pytest.mark.parametrize("store", ["memcached", "redis", "postgres"])
def test_a_new_projects_three_tests_pass(
    project, store, eager, memcached, redis_server, request
):
    directory, python = project
    base = redis_server.url.rsplit("/", 1)[0]
    locations = {"memcached": f"memcached://{memcached.address}", "redis": f"{base}/6"}
    if store == "postgres":
        locations["postgres"] = request.getfixturevalue("project_database")
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTEST_", "DJANGO_"))
        },
        "PROJ_LOCK_STORE": locations[store],
        "PROJ_BROKER": f"{base}/7",
        "PROJ_RESULTS": f"{base}/8",
        "PROJ_EAGER": eager,
    }
    env.pop("PYTHONPATH", None)  # the installed wheel, not this checkout
    result = _run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=directory,
        env=env,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "3 passed" in out, out
    # The project runs the installed package (the plugin came with it: a
    # test asking for an unknown fixture errors).
    where = _run(
        [str(python), "-c", "import django_tasklock; print(django_tasklock.__file__)"],
        cwd=directory,
        env=env,
    )
    assert where.stdout.startswith(str(python.parent.parent)), where.stdout
