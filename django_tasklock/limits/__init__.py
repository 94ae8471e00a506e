"""Cluster-wide rate limits: ``RateLimiter`` (limiter.py), its two kinds
(kinds.py), its state in the lock store (store.py) and ``@rate_limited`` for
tasks (decorator.py). Rates as users write them are parsed in ``rates``, at the
bottom of the package, which ``conf`` reads too."""
