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
    # PostgreSQL alone: the project's database holds its locks (the table
    # made by django_tasklock's migration).
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

if os.environ.get("PROJ_TASKS") == "db":
    # No broker at all: Django's tasks framework, its database backend
    # (django-tasks-db) queueing in the project's database.
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
else:
    CELERY_BROKER_URL = os.environ["PROJ_BROKER"]
    CELERY_RESULT_BACKEND = os.environ["PROJ_RESULTS"]
    CELERY_TASK_ALWAYS_EAGER = os.environ.get("PROJ_EAGER") == "1"
