"""Locks: take, renew, release, recover, fence (``django_tasklock.locks``)."""
