"""Settings for the test suite.

The memcached and Redis servers are private instances the test session starts on
free loopback ports (see ``tests/services.py``); their addresses arrive in the
environment, so that worker processes spawned by the tests see the same CACHES.
"""

from __future__ import annotations

import os
import tempfile

SECRET_KEY = "django_tasklock-tests-not-secret"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_tasklock",
    "example_project.feeds",
    # Models for the fenced-write tests (tests/fenced).
    "tests.fenced",
]
# The admin, for the lock console's tests (tests/test_console*.py).
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
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
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    # A file, which the fenced-write tests' processes share (tests/fenced).
    "sqlite_file": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": "unused",
        "TEST": {
            "NAME": os.path.join(
                tempfile.gettempdir(), f"tasklock-test-{os.getpid()}.sqlite3"
            )
        },
    },
    # The session's PostgreSQL (tests/services_pg.py), directly and through
    # PgBouncer in transaction pooling mode: the PostgreSQL store's databases.
    "pg": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "tasklock",
        "USER": "tasklock",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("TASKLOCK_TEST_POSTGRES", "5999"),
    },
    "pgbouncer": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "tasklock",
        "USER": "tasklock",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("TASKLOCK_TEST_PGBOUNCER", "5998"),
    },
    # For tests/backends/postgres: a Django TestCase's own test database on the
    # session's server; a database with no lock table; a server a test starts.
    "pg_tests": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "tasklock_tests",
        "USER": "tasklock",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("TASKLOCK_TEST_POSTGRES", "5999"),
    },
    "pg_no_table": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "postgres",
        "USER": "tasklock",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("TASKLOCK_TEST_POSTGRES", "5999"),
    },
    "pg_own": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "tasklock",
        "USER": "tasklock",
        "HOST": "127.0.0.1",
        "PORT": "5997",
    },
}

MEMCACHED = os.environ.get("TASKLOCK_TEST_MEMCACHED", "127.0.0.1:11211")
MEMCACHED_PAIR = os.environ.get("TASKLOCK_TEST_MEMCACHED_PAIR", MEMCACHED).split(",")
TWEMPROXY = os.environ.get("TASKLOCK_TEST_TWEMPROXY", "127.0.0.1:22121")
REDIS = os.environ.get("TASKLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0")
# A node of the session's Redis Cluster (started only for the tests that ask
# for it: tests/conftest.py, ``redis_cluster``).
CLUSTER = os.environ.get("TASKLOCK_TEST_CLUSTER", "redis://127.0.0.1:7000")

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": MEMCACHED,
    },
    "prefixed": {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": MEMCACHED,
        "KEY_PREFIX": "site-a",
        "VERSION": 3,
        "KEY_FUNCTION": "tests.keyfuncs.reversed_key",
    },
    "pair": {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": MEMCACHED_PAIR,
    },
    # twemproxy in front of the memcached pair (tests/backends/memcached/test_proxies.py starts it).
    "twemproxy": {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": TWEMPROXY,
    },
    "redis": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS,
    },
    # django-redis, on the same Redis server and database as "redis".
    "django_redis": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS,
    },
    # libmemcached, on the same memcached as "default".
    "pylibmc": {
        "BACKEND": "django.core.cache.backends.memcached.PyLibMCCache",
        "LOCATION": MEMCACHED,
        # pylibmc 1.6.3 looks keys up in ``behaviors`` even when it is None, which
        # Python 3.13 reports as an ignored TypeError (an error in this suite).
        "OPTIONS": {"behaviors": {"tcp_nodelay": True}},
    },
    "locmem": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    # Locks in the session's PostgreSQL, directly and through PgBouncer.
    "postgres": {
        "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
        "LOCATION": "pg",
    },
    "pgbouncer": {
        "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
        "LOCATION": "pgbouncer",
    },
    # django-valkey's cluster cache, on the session's Redis Cluster.
    "cluster": {
        "BACKEND": "django_valkey.cluster_cache.cache.ClusterValkeyCache",
        "LOCATION": CLUSTER,
    },
}

# Stores a test builds for one deployment (tests/backends/test_liveness_deployments.py),
# as JSON, so the holder processes it starts see them too.
if os.environ.get("TASKLOCK_TEST_EXTRA_CACHES"):
    import json

    CACHES.update(json.loads(os.environ["TASKLOCK_TEST_EXTRA_CACHES"]))
# And the databases a PostgresCache among them names (reliability/checker.py).
# A MariaDB for the fenced writes' data (tests/fenced/test_on_mariadb.py runs
# their tests again in a session of their own with it): only then, since
# Django 6's system checks ask every MySQL alias's server for its version.
if os.environ.get("TASKLOCK_TEST_MARIADB"):
    DATABASES["mysql"] = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": "tasklock",
        "USER": "root",
        "HOST": "127.0.0.1",
        "PORT": os.environ["TASKLOCK_TEST_MARIADB"],
    }
if os.environ.get("TASKLOCK_TEST_EXTRA_DATABASES"):
    import json

    DATABASES.update(json.loads(os.environ["TASKLOCK_TEST_EXTRA_DATABASES"]))

TASKLOCK: dict[str, object] = {"LOCK_EXPIRE": 60}
# Worker processes of the cluster's fault cases (reliability/cluster.py) lock
# in another alias.
if os.environ.get("TASKLOCK_TEST_CACHE"):
    TASKLOCK["CACHE"] = os.environ["TASKLOCK_TEST_CACHE"]
# Worker processes of the metrics tests (tests/console/test_metrics.py) export them.
if os.environ.get("TASKLOCK_TEST_METRICS"):
    TASKLOCK["METRICS"] = "prometheus"
