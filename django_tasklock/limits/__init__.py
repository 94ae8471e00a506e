"""Cluster-wide rate limits: ``RateLimiter`` (limiter.py), its two kinds
(kinds.py), its state in the lock store (store.py), rates as users write them
(rates.py) and ``@rate_limited`` for tasks (decorator.py).

Nothing is imported here, so that ``conf`` can read rates without importing
the limiter (which imports ``conf``)."""
