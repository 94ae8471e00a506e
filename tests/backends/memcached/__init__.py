"""The memcached store (``django_tasklock.backends.memcached``)."""
