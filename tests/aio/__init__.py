"""The asyncio API (``django_tasklock.aio`` and the locks' async twins)."""
