"""The Celery app of the highly available beat tests (tests/integrations/test_beat.py):
``celery -A tests.beat_app beat`` (with ``BEAT_DATABASE``, on
django-celery-beat's tables in that SQLite file). Its schedule: ``BEAT_ENTRIES`` entries,
each every second. Every message a beat publishes is recorded, with the time,
the beat's host and the run it is (the time ``LeaderScheduler`` stored for it,
from the message's headers), in the Redis list ``beat-sends`` (Celery's own
``before_task_publish`` signal, sent by the beat that publishes): what was
sent, counted apart from the scheduler that decides it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import time

import django

# Every thread's stack to the log on SIGUSR1 (``Beat.stacks``): where a beat
# that should have sent was stuck, for a failed test's message.
faulthandler.register(signal.SIGUSR1, all_threads=True)

if os.environ.get("BEAT_DATABASE"):
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.beat_settings"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

import redis  # noqa: E402
from celery import Celery  # noqa: E402
from celery.signals import before_task_publish  # noqa: E402
from django.conf import settings  # noqa: E402

settings.TASKLOCK = {"CACHE": os.environ.get("BEAT_CACHE", "default"), "LIVENESS": 3}

app = Celery("beatha", set_as_current=True)
app.conf.update(
    broker_url=os.environ["BEAT_BROKER"],
    beat_max_loop_interval=0.2,
    beat_schedule={
        f"entry-{n}": {"task": "beatha.tick", "schedule": 1.0, "args": [f"entry-{n}"]}
        for n in range(int(os.environ.get("BEAT_ENTRIES", "2")))
    },
)
if "-S" in sys.argv and "redbeat" in sys.argv[sys.argv.index("-S") + 1]:
    # RedBeat (benchmarks/beat.py, beside LeaderScheduler): its schedule and
    # lock in the broker's Redis; the lock as long as LIVENESS there.
    app.conf.update(redbeat_redis_url=os.environ["BEAT_BROKER"], redbeat_lock_timeout=3)
_sends = redis.Redis.from_url(os.environ["BEAT_BROKER"])


@before_task_publish.connect
def _record(sender=None, headers=None, **_):
    headers = headers or {}
    entry = headers.get("argsrepr", "")
    run = headers.get("tasklock_beat_run")  # LeaderScheduler's
    record = {
        "entry": entry.strip("[]()', "),
        "run": None if run is None else run / 1000,
        # The sending leader's fence (LeaderScheduler's): a later term of
        # the leadership has a larger one.
        "fence": headers.get("tasklock_beat_fence"),
        "at": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    _sends.rpush("beat-sends", json.dumps(record))
