"""The Redis stores: Redis Cluster, django-redis (``django_tasklock.backends.redis``)."""
