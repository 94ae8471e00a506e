"""Celery stays optional: nothing of django_tasklock imports it (or the
packages it brings: kombu, billiard, amqp, vine), locks and the command work
without it. (A new project without Celery installed at all runs in
test_new_project.py.)"""

from __future__ import annotations

import subprocess
import sys

from tests.services import ROOT

SCRIPT = """
import sys
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django_tasklock"],
    CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}},
    SILENCED_SYSTEM_CHECKS=["django_tasklock.W001"],
)
import django
django.setup()
import django_tasklock, django_tasklock.status, django_tasklock.signals
from django.core.management import call_command
from django_tasklock import Lock, single_instance

@single_instance(renew=True, expire=3)
def work():
    return django_tasklock.current_lock().fence

assert work() > 0
with Lock("plain") as lock:
    call_command("tasklock", "status", "plain")
call_command("check")
celery_parts = ("celery", "kombu", "billiard", "amqp", "vine")
loaded = sorted(name for name in sys.modules if name.split(".")[0] in celery_parts)
print("LOADED", loaded)
"""


def test_nothing_imports_celery():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Held:       yes" in result.stdout
    assert "LOADED []" in result.stdout, result.stdout
