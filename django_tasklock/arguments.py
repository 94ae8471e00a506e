"""What identifies a call: its arguments, bound to the signature, as canonical JSON.

``f(1, b=2)``, ``f(1, 2)`` and ``f(b=2, a=1)`` are one call once bound with
defaults applied; tuples and lists are alike and dict order does not matter, so a
call hashes the same before and after its message went through JSON.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from django.core.serializers.json import DjangoJSONEncoder

if TYPE_CHECKING:
    import inspect

__all__ = ["KeySpec", "call_digest", "canonical_json", "md5_hex"]

#: What ``key=`` may be: an argument name, several names, or a callable taking the
#: call's arguments and returning a str.
KeySpec = str | list[str] | tuple[str, ...] | Callable[..., str] | None


class _Encoder(DjangoJSONEncoder):
    """Django's encoder (UUID, Decimal, date, duration, lazy strings...), with
    datetimes and times at full precision, as kombu's JSON writes them."""

    def default(self, o: Any) -> Any:
        naive_time = isinstance(o, datetime.time) and o.utcoffset() is None
        if isinstance(o, datetime.datetime) or naive_time:
            text = o.isoformat()
            return text[:-6] + "Z" if text.endswith("+00:00") else text
        return super().default(o)


def md5_hex(text: str) -> str:
    """MD5 hex digest of ``text``'s UTF-8 bytes, the cookbook's digest."""
    return hashlib.md5(
        text.encode("utf-8", "surrogatepass"), usedforsecurity=False
    ).hexdigest()


def canonical_json(value: object) -> str:
    """``value`` as compact JSON with sorted keys; raises TypeError if it can't be."""
    return json.dumps(
        value,
        cls=_Encoder,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )


def bind_arguments(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def call_digest(task_name: str, arguments: Mapping[str, Any], key: KeySpec) -> str:
    """The MD5 hex digest that identifies a call of ``task_name``.

    ``arguments`` are the bound arguments (the bound task itself left out).
    Raises TypeError naming the argument that cannot be serialised.
    """
    if isinstance(key, str):
        if key not in arguments:
            raise TypeError(
                f"key={key!r} of {task_name} is not an argument of the call."
            )
        value = arguments[key]
        if isinstance(value, str):
            # The very digest the cookbook builds: md5(feed_url).hexdigest().
            return md5_hex(value)
        return md5_hex(_serialise(task_name, key, value))
    if key is None or isinstance(key, (list, tuple)):
        names = arguments if key is None else key
        parts = [
            f"{name}={_serialise(task_name, name, arguments[name])}" for name in names
        ]
        if key is None:
            parts.sort()
        return md5_hex("&".join(parts))
    text = key(**arguments)
    if not isinstance(text, str):
        raise TypeError(
            f"The key= callable of {task_name} returned {type(text).__name__}, not str; "
            "return a str that identifies the call."
        )
    return md5_hex(text)


def _serialise(task_name: str, name: str, value: object) -> str:
    try:
        return canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"single_instance cannot build the lock id of {task_name}: argument "
            f"{name!r} ({type(value).__name__}) is not JSON-serialisable ({exc}). "
            "Pass JSON-friendly values (str, numbers, lists, dicts, UUID, datetime, "
            "Decimal), or key= naming the arguments that identify a call."
        ) from exc
