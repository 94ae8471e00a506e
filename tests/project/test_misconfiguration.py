"""Misconfiguration never silently disables locking: each mistake a newcomer
made is refused at ``manage.py check`` and, in a process that never ran the
check (a worker), at the first lock."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.core.checks import run_checks

from django_tasklock import Lock, LockConfigurationError, declared, single_instance
from django_tasklock.checks import check_settings
from django_tasklock.declared import named_aliases
from tests.helpers import ROOT


def run_project(
    tmp_path: Path, settings_body: str, code: str
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh process whose Django settings are ``settings_body``."""
    (tmp_path / "misconfigured_settings.py").write_text(textwrap.dedent(settings_body))
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{tmp_path}:{ROOT}",
        "DJANGO_SETTINGS_MODULE": "misconfigured_settings",
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


NO_CACHES = """
    SECRET_KEY = "x"
    INSTALLED_APPS = ["django_tasklock"]
    TASKLOCK = {"LOCK_EXPIRE": 30}
"""


def test_no_caches_setting_is_an_error_at_check_time(tmp_path):
    done = run_project(
        tmp_path,
        NO_CACHES,
        """
        import django
        django.setup()
        from django.core.management import call_command
        call_command("check")
        """,
    )
    assert done.returncode != 0
    assert "django_tasklock.E015" in done.stderr
    assert "CACHES is not set" in done.stderr
    assert "W001" not in done.stderr  # the Error says it all


def test_no_caches_setting_refuses_every_lock_at_run_time(tmp_path):
    done = run_project(
        tmp_path,
        NO_CACHES,
        """
        import django
        django.setup()
        from django_tasklock import LockConfigurationError, single_instance

        ran = []

        @single_instance
        def job(x):
            ran.append(x)

        try:
            job(1)
        except LockConfigurationError as exc:
            print("REFUSED", exc)
        print("RAN", ran)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED CACHES is not set" in done.stdout
    assert "Set CACHES" in done.stdout
    assert "RAN []" in done.stdout


def test_locmem_the_project_chose_stays_a_warning(settings):
    settings.TASKLOCK = {"CACHE": "locmem"}
    assert [m.id for m in check_settings()] == ["django_tasklock.W001"]
    with Lock("chosen-locmem") as lock:
        assert lock.owned()


def test_misspelt_key_refuses_to_lock_at_run_time(settings, memcached):
    settings.TASKLOCK = {"LOCK_EXPRIE": 5}
    ran = []

    @single_instance
    def job(x):
        ran.append(x)

    for attempt in (lambda: Lock("typo").acquire(), lambda: job(1)):
        with pytest.raises(LockConfigurationError) as caught:
            attempt()
        assert "'LOCK_EXPRIE'" in str(caught.value)
        assert "Did you mean 'LOCK_EXPIRE'?" in str(caught.value)
    assert ran == []
    # Also when the misspelt key sits beside valid ones the hot path memoised.
    settings.TASKLOCK = {"LOCK_EXPIRE": 5}
    assert Lock("typo").acquire()
    settings.TASKLOCK["QUEUE_EXPRIE"] = 5  # changed in place
    with pytest.raises(LockConfigurationError, match="Did you mean 'QUEUE_EXPIRE'"):
        Lock("typo-2").acquire()


def test_misspelt_key_check_names_the_key_meant_in_its_hint(settings):
    settings.TASKLOCK = {"LOCK_EXPRIE": 5}
    [message] = check_settings()
    assert message.id == "django_tasklock.E001"
    assert message.hint == "Rename 'LOCK_EXPRIE' to 'LOCK_EXPIRE'."
    settings.TASKLOCK = {"ZZZ": 5}
    [message] = check_settings()
    assert message.hint.startswith(
        "Remove 'ZZZ'; known keys: ALLOW_PER_PROCESS, BEAT_MISSED, CACHE,"
    )


def test_check_covers_every_alias_a_decorated_task_names(settings, monkeypatch):
    monkeypatch.setattr(declared, "_aliases", {})  # this test's tasks only

    @single_instance(cache="nowhere")
    def missing(x):
        return x

    @single_instance(cache="locmem")
    def local(x):
        return x

    messages = [m for m in run_checks(tags=["caches"]) if m.id.startswith("django_")]
    by_id = {m.id: m.msg for m in messages}
    assert "django_tasklock.E003" in by_id
    assert "@single_instance(cache='nowhere') of " in by_id["django_tasklock.E003"]
    assert "missing" in by_id["django_tasklock.E003"]
    assert "local" in by_id["django_tasklock.W001"]
    assert set(named_aliases()) == {"nowhere", "locmem"}


def test_check_imports_installed_apps_task_modules(tmp_path):
    (tmp_path / "lockapp").mkdir()
    (tmp_path / "lockapp" / "__init__.py").write_text("")
    (tmp_path / "lockapp" / "tasks.py").write_text(
        textwrap.dedent(
            """
            from django_tasklock import single_instance

            @single_instance(cache="results")
            def import_feed(url):
                return url
            """
        )
    )
    done = run_project(
        tmp_path,
        """
        SECRET_KEY = "x"
        INSTALLED_APPS = ["django_tasklock", "lockapp"]
        CACHES = {
            "default": {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": "redis://127.0.0.1:1/0",
            }
        }
        """,
        """
        import django
        django.setup()
        from django.core.management import call_command
        call_command("check")
        """,
    )
    assert done.returncode != 0
    assert "django_tasklock.E003" in done.stderr
    assert (
        "@single_instance(cache='results') of lockapp.tasks.import_feed" in done.stderr
    )
