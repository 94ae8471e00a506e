"""Celery and Django tasks: the decorators, calls stopped at ``.delay()``, beat, leadership."""
