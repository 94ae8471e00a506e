"""A test that leaves a lock held by mistake: the plugin fails it."""

from __future__ import annotations

import os

import pytest

from django_tasklock import Lock


@pytest.fixture(autouse=True)
def lock_cache(settings):
    settings.TASKLOCK = {"CACHE": os.environ["SAMPLE_CACHE"], "LOCK_EXPIRE": 60}


def test_forgets_to_release(tasklock):
    assert Lock("sample-forgotten").acquire()
