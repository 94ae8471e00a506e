"""``manage.py tasklock rate``: a rate limit's state, and the two things an
operator does to one: pause it (a partner asked for a break) and reset it.

::

    manage.py tasklock rate partner-api                 # a TASKLOCK['RATE_LIMITS'] name
    manage.py tasklock rate feeds.fetch                 # a @rate_limited task's
    manage.py tasklock rate feeds.fetch-<digest>        # ... one of its keyed limits
    manage.py tasklock rate other --rate 10/m           # any limit id, with its rate
    manage.py tasklock rate partner-api --pause 30
    manage.py tasklock rate partner-api --reset
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser

from ..conf import RATE_KINDS, settings
from ..exceptions import LockBackendError, LockConfigurationError
from ..limits.limiter import RateLimiter

__all__ = ["add_rate_parser", "rate_action"]


def add_rate_parser(actions: Any) -> None:
    rate: CommandParser = actions.add_parser(
        "rate", help="A rate limit's state; --pause or --reset it."
    )
    rate.add_argument(
        "limit_id",
        help="The limit id: a RATE_LIMITS name, a @rate_limited name (or one of "
        "its keyed limits, <name>-<digest>), or any with --rate.",
    )
    rate.add_argument(
        "--rate",
        help='Its rate ("10/m"), unless declared (RATE_LIMITS, @rate_limited).',
    )
    rate.add_argument("--kind", choices=RATE_KINDS)
    rate.add_argument("--burst", type=int)
    rate.add_argument("--cache", help="The CACHES alias (default: TASKLOCK's).")
    rate.add_argument("--json", action="store_true", help="Print JSON.")
    change = rate.add_mutually_exclusive_group()
    change.add_argument(
        "--pause",
        type=float,
        metavar="SECONDS",
        help="Stop admissions for this long, in every process.",
    )
    change.add_argument(
        "--reset", action="store_true", help="Forget its admissions and any pause."
    )


def _declared(limit_id: str) -> RateLimiter | None:
    """The limiter a ``@rate_limited`` of the installed apps declares under
    ``limit_id`` (its name, or a keyed limit's ``<name>-<digest>``), with the
    declared rate; None if none does."""
    from ..declared import import_task_modules
    from ..limits.decorator import declared_limit

    import_task_modules()
    limits = declared_limit(limit_id)
    return None if limits is None else limits._make(limit_id)


def rate_action(stdout: Any, options: dict[str, Any]) -> None:
    try:
        limit_id = options["limit_id"]
        declared = None
        if options["rate"] is None and limit_id not in settings.rate_limit_names():
            declared = _declared(limit_id)
        overrides = [options[name] for name in ("kind", "burst", "cache")]
        if declared is not None and overrides == [None, None, None]:
            limiter = declared
        else:
            limiter = RateLimiter(
                limit_id,
                options["rate"] if declared is None else declared.rate,
                kind=options["kind"],
                burst=options["burst"],
                cache=options["cache"],
            )
        if options["pause"] is not None:
            left = limiter.pause(options["pause"])
            stdout.write(
                f"Paused {limiter.limit_id!r}: admissions resume in {left:.1f}s."
            )
        elif options["reset"]:
            had = limiter.reset()
            stdout.write(
                f"Reset {limiter.limit_id!r}."
                if had
                else f"{limiter.limit_id!r} had nothing to reset."
            )
        state = limiter.state()
    except (TypeError, ValueError, LockBackendError, LockConfigurationError) as exc:
        raise CommandError(str(exc)) from exc
    if options["json"]:
        stdout.write(json.dumps(state, default=str))
        return
    for field, value in state.items():
        shown = f"{value:.2f}s" if isinstance(value, float) else value
        stdout.write(f"{field + ':':<30}{shown}")
