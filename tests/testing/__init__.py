"""The testing helpers (``django_tasklock.testing``)."""
