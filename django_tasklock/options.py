"""The options of ``@single_instance``, checked when the decorator is applied."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, get_args

from .conf import (
    DECORATOR_CONTENTION,
    DEFAULT_PARK,
    PARK_FULL_POLICIES,
    TIMEOUT_POLICIES,
    validate_bool,
    validate_choice,
    validate_expire,
    validate_seconds,
)
from .exceptions import InvalidArgumentType
from .locks import ON_LOST_POLICIES, OnLost
from .semaphores import validate_limit

if TYPE_CHECKING:
    from .arguments import KeySpec

__all__ = ["ModeName", "OnContention", "OnDuplicate", "OnParkFull", "Options"]

OnContention = Literal["skip", "raise", "retry", "wait", "park"]
OnParkFull = Literal["refuse", "drop_oldest", "replace"]
ModeName = Literal["while_running", "until_finished", "until_started", "coalesce"]
OnDuplicate = Literal["join", "raise", "replace"]
#: The names ``mode=`` and ``on_duplicate=`` take, from the types above (the
#: tables in ``modes`` and ``policies.duplicates`` hold what each does; a test
#: keeps them in step). Not read from those tables: they sit above this module.
MODE_NAMES: tuple[str, ...] = get_args(ModeName)
DUPLICATE_NAMES: tuple[str, ...] = get_args(OnDuplicate)


@dataclasses.dataclass(frozen=True)
class Options:
    """The decorator's options, validated, as given (None: read TASKLOCK)."""

    key: KeySpec = None
    expire: float | None = None
    on_contention: OnContention | None = None
    timeout: float | None = None
    on_timeout: str = "skip"
    countdown: float | None = None
    cache: str | None = None
    renew: bool | None = None
    max_hold: float | None = None
    on_lost: OnLost = "warn"
    limit: int | None = None
    mode: str = "while_running"
    on_duplicate: str = "join"
    queue_expire: float | None = None
    #: How many calls may wait parked (``on_contention="park"``).
    park: int | None = None
    on_park_full: str = "refuse"
    #: The options every lock of these runs is made with, those given only
    #: (set in __post_init__; a run's own are added to them).
    lock_options: dict[str, Any] = dataclasses.field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.expire is not None:
            validate_expire(self.expire)
        if self.on_contention is not None:
            validate_choice(
                self.on_contention, name="on_contention", choices=DECORATOR_CONTENTION
            )
        if self.timeout is not None:
            validate_seconds(self.timeout, name="timeout")
        if self.countdown is not None:
            validate_seconds(self.countdown, name="countdown", allow_zero=True)
        validate_choice(self.on_timeout, name="on_timeout", choices=TIMEOUT_POLICIES)
        if self.renew is not None:
            validate_bool(self.renew, name="renew")
        if self.max_hold is not None:
            validate_seconds(self.max_hold, name="max_hold")
        if self.limit is not None:
            validate_limit(self.limit)
        validate_choice(self.on_lost, name="on_lost", choices=ON_LOST_POLICIES)
        validate_choice(self.mode, name="mode", choices=MODE_NAMES)
        validate_choice(self.on_duplicate, name="on_duplicate", choices=DUPLICATE_NAMES)
        if self.queue_expire is not None:
            validate_expire(self.queue_expire, name="queue_expire")
        if self.mode != "while_running" and self.limit not in (None, 1):
            raise InvalidArgumentType(
                f"limit= works with mode='while_running' only, not mode={self.mode!r}: "
                "a call is pending under one lock id. Drop limit=, or the mode."
            )
        self._check_park()
        given = {
            "expire": self.expire,
            "cache": self.cache,
            "renew": self.renew,
            # A Lock's own default ("warn") is left out: a run's lock made with
            # no options is a call without ``**`` (see Mode.lock_for).
            "on_lost": None if self.on_lost == "warn" else self.on_lost,
        }
        self.lock_options.update((k, v) for k, v in given.items() if v is not None)

    def _check_park(self) -> None:
        validate_choice(
            self.on_park_full, name="on_park_full", choices=PARK_FULL_POLICIES
        )
        parks = self.on_contention == "park"
        if not parks and (self.park is not None or self.on_park_full != "refuse"):
            raise InvalidArgumentType(
                "park= and on_park_full= size and govern the line of "
                "on_contention='park'; add on_contention='park', or drop them."
            )
        if not parks:
            return
        if self.park is not None:
            validate_limit(self.park, name="park")
        else:
            object.__setattr__(self, "park", DEFAULT_PARK)
        if self.mode != "while_running":
            raise InvalidArgumentType(
                f"on_contention='park' parks calls that find every slot taken "
                f"when they run (mode='while_running'), not with mode={self.mode!r}, "
                "whose calls are held when they are sent. Drop one of the two."
            )
