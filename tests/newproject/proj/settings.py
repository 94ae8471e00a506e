import os

SECRET_KEY = "not-secret"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_tasklock",
    "shop",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}

STORE = os.environ["PROJ_LOCK_STORE"]
if STORE.startswith("postgres://"):
    # PostgreSQL alone: the project's database holds its locks.
    address, name = STORE.removeprefix("postgres://").split("/")
    host, port = address.split(":")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": "tasklock",
            "HOST": host,
            "PORT": port,
        }
    }
    CACHES = {
        "default": {
            "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
            "LOCATION": "default",
        }
    }
elif STORE.startswith("redis://"):
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": STORE,
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": STORE.removeprefix("memcached://"),
        }
    }
TASKLOCK = {"LOCK_EXPIRE": 60}

CELERY_BROKER_URL = os.environ["PROJ_BROKER"]
CELERY_RESULT_BACKEND = os.environ["PROJ_RESULTS"]
CELERY_TASK_ALWAYS_EAGER = os.environ.get("PROJ_EAGER") == "1"
