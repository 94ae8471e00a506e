"""The test settings with django-celery-beat, on the SQLite file
``BEAT_DATABASE`` that every beat process of a test shares
(tests/integrations/test_beat.py)."""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["BEAT_DATABASE"],
        "OPTIONS": {"timeout": 30},
    }
}
