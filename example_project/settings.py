"""Settings of the example project. Everything that differs between a developer's
machine and the demo comes from the environment:

- ``EXAMPLE_LOCK_STORE``: ``memcached://HOST:PORT`` (default 127.0.0.1:11211),
  ``redis://HOST:PORT/DB``, ``valkey-cluster://HOST:PORT`` (a node of a Redis
  or Valkey Cluster, through django-valkey) or ``postgres://HOST:PORT/NAME``
  (PostgreSQL as the only store: the database, and the locks in it): the
  cache that holds the task locks;
- ``EXAMPLE_DATABASE``: the SQLite file (default ``.tasklock-run/example.sqlite3``);
- ``CELERY_BROKER_URL``: the broker; without it, kombu's filesystem transport in
  ``EXAMPLE_BROKER_DIR`` (default ``.tasklock-run/broker``), which needs no server;
- ``CELERY_RESULT_BACKEND``: where results go; without it, Celery's filesystem
  backend in ``EXAMPLE_RESULTS_DIR`` (default ``.tasklock-run/results``).
"""

from __future__ import annotations

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent.parent
RUN_DIR = BASE_DIR / ".tasklock-run"

SECRET_KEY = os.environ.get("EXAMPLE_SECRET_KEY", "example-project-not-secret")
DEBUG = os.environ.get("EXAMPLE_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_tasklock",
    "example_project.feeds",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DATABASE", str(RUN_DIR / "example.sqlite3")),
        # Several worker processes write at once: wait for SQLite's lock, and take
        # it when a transaction begins (a read that turns into a write could not wait).
        "OPTIONS": {
            "timeout": 30,
            **({"transaction_mode": "IMMEDIATE"} if django.VERSION >= (5, 1) else {}),
        },
    }
}

LOCK_STORE = os.environ.get("EXAMPLE_LOCK_STORE", "memcached://127.0.0.1:11211")
if LOCK_STORE.startswith("postgres://"):
    # PostgreSQL only: the project's database holds its locks too.
    _address, _name = LOCK_STORE.removeprefix("postgres://").split("/")
    _host, _port = _address.split(":")
    DATABASES["default"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _name,
        "USER": "tasklock",
        "HOST": _host,
        "PORT": _port,
    }
    CACHES = {
        "default": {
            "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
            "LOCATION": "default",
        }
    }
elif LOCK_STORE.startswith("valkey-cluster://"):
    CACHES = {
        "default": {
            "BACKEND": "django_valkey.cluster_cache.cache.ClusterValkeyCache",
            "LOCATION": "redis://" + LOCK_STORE.removeprefix("valkey-cluster://"),
        }
    }
elif LOCK_STORE.startswith("redis://"):
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": LOCK_STORE,
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": LOCK_STORE.removeprefix("memcached://"),
        }
    }

TASKLOCK = {"LOCK_EXPIRE": 300, "METRICS": "prometheus"}
# django.tasks (Django 6 and later; an unused setting on 5.2): tasks run where
# they are enqueued (feeds/jobs.py, the demo's django.tasks step).
TASKS = {"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}

BROKER_DIR = Path(os.environ.get("EXAMPLE_BROKER_DIR", str(RUN_DIR / "broker")))
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL == "filesystem://":
    # kombu's filesystem transport, with atomic writes: see filesystem_broker.py.
    CELERY_BROKER_TRANSPORT = "example_project.filesystem_broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "control_folder": str(BROKER_DIR / "control"),
        "polling_interval": 0.05,
    }
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Results on Celery's filesystem backend (no server either), so that .get()
# and a joined duplicate's result work here as the docs show.
RESULTS_DIR = Path(os.environ.get("EXAMPLE_RESULTS_DIR", str(RUN_DIR / "results")))
RESULTS_DIR.mkdir(parents=True, exist_ok=True)
CELERY_RESULT_BACKEND = os.environ.get(
    "CELERY_RESULT_BACKEND", f"file://{RESULTS_DIR.resolve()}"
)
CELERY_RESULT_EXPIRES = 3600
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery beat on as many hosts as you like, one sending (docs: One leader among
# processes): ``celery -A example_project beat`` on each.
CELERY_BEAT_SCHEDULER = "django_tasklock.integrations.celery.beat:LeaderScheduler"
CELERY_BEAT_MAX_LOOP_INTERVAL = 1
CELERY_BEAT_SCHEDULE = {
    "check-stale-feeds": {
        "task": "example_project.feeds.tasks.check_stale_feeds",
        "schedule": 1.0,
    },
    "count-entries": {
        "task": "example_project.feeds.tasks.count_entries",
        "schedule": 1.0,
    },
}

#: Where the demo's local feed server lives; the importer fetches from here.
FEED_TIMEOUT = 10
#: At most this many feeds are fetched at once from one host, across every worker
#: (a django_tasklock Semaphore per host; see feeds/importer.py).
FEED_FETCHES_PER_HOST = 2
#: And at most this many fetches per period from one host, across every worker
#: (a django_tasklock RateLimiter per host, the window kind: a feed server's
#: politeness limit). A 429 answer with Retry-After pauses that host's limit.
FEED_FETCH_RATE = "20/5s"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"short": {"format": "%(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "short"}},
    "loggers": {
        "django_tasklock": {"handlers": ["console"], "level": "INFO"},
        "example_project": {"handlers": ["console"], "level": "INFO"},
    },
}
