"""What identifies a call: its arguments, bound to the signature, as canonical JSON.

``f(1, b=2)``, ``f(1, 2)`` and ``f(b=2, a=1)`` are one call once bound with
defaults applied; tuples and lists are alike and dict order does not matter, so a
call hashes the same before and after its message went through JSON.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from django.core.serializers.json import DjangoJSONEncoder

from .exceptions import InvalidArgument, InvalidArgumentType

if TYPE_CHECKING:
    import inspect

__all__ = ["KeySpec", "call_digest", "canonical_json", "check_key", "md5_hex"]

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


def _md5_maker() -> Callable[[bytes], Any]:
    """CPython's own MD5 (``_md5``), if this build has it: the same digest as
    hashlib's, without the OpenSSL provider lookup hashlib's costs per digest
    (about 40 % of an MD5 of a short text, and most of a lock id). Not a
    security use: a lock id's digest."""
    try:
        builtin = importlib.import_module("_md5")
    except ImportError:
        return functools.partial(hashlib.md5, usedforsecurity=False)
    made: Callable[[bytes], Any] = builtin.md5
    return made


_new_md5 = _md5_maker()


def md5_hex(text: str) -> str:
    """MD5 hex digest of ``text``'s UTF-8 bytes, the cookbook's digest."""
    return _new_md5(text.encode("utf-8", "surrogatepass")).hexdigest()  # type: ignore[no-any-return]


_ENCODER = _Encoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
# What that encoder writes for a str, in C: the most common argument, and the
# encoder itself costs more than the rest of a lock id.
_encode_str: Callable[[str], str] = json.encoder.encode_basestring


def canonical_json(value: object) -> str:
    """``value`` as compact JSON with sorted keys, written as it reads after any
    serializer's round trip; raises TypeError (or ValueError) if it can't be.

    Dict keys are written as JSON makes them (``1`` as ``"1"``, ``True`` as
    ``"true"``, ``None`` as ``"null"``) before they are sorted, so a dict with
    int keys has one text at ``.delay()`` and in the worker, after JSON turned
    its keys to strings (and msgpack or pickle did not).
    """
    kind = type(value)
    if kind is str:
        return _encode_str(value)  # type: ignore[arg-type]
    if kind is int:
        return repr(value)
    if isinstance(value, (dict, list, tuple)):
        value = _with_json_keys(value)
    return _ENCODER.encode(value)


def _json_key(key: object) -> str:
    """A dict key as JSON writes it (json.encoder's own rules)."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        text: str = _ENCODER.encode(key)  # refuses NaN and infinities
        return text
    raise InvalidArgumentType(
        f"a dict key must be a str, int, float, bool or None, not "
        f"{type(key).__name__} ({key!r}): JSON cannot send it"
    )


def _with_json_keys(value: object) -> object:
    """``value`` with every dict's keys as JSON writes them."""
    if isinstance(value, dict):
        converted: dict[str, object] = {}
        for key, item in value.items():
            text = _json_key(key)
            if text in converted:
                raise InvalidArgumentType(
                    f"a dict has two keys that JSON writes as {text!r} (such as 1 "
                    "and '1'): after the message's round trip only one is left. "
                    "Use keys of one type"
                )
            converted[text] = _with_json_keys(item)
        return converted
    if isinstance(value, (list, tuple)):
        return [_with_json_keys(item) for item in value]
    return value


def bind_arguments(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def binder(
    signature: inspect.Signature,
) -> Callable[[tuple[Any, ...], Mapping[str, Any]], dict[str, Any]]:
    """``bind_arguments`` for one signature, made once.

    For the common signature (plain parameters, no ``*args``, ``**kwargs`` or
    keyword-only ones) it maps the call by hand, which costs a fraction of
    ``Signature.bind``; any other signature, and any call that does not fit
    (``Signature.bind`` then raises the TypeError Python would), goes through
    ``Signature.bind``.
    """
    import inspect

    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = list(signature.parameters.values())
    if any(parameter.kind is not plain for parameter in parameters):
        return lambda args, kwargs: bind_arguments(signature, args, kwargs)
    names = tuple(parameter.name for parameter in parameters)
    defaults = {
        parameter.name: parameter.default
        for parameter in parameters
        if parameter.default is not inspect.Parameter.empty
    }
    count = len(names)
    # A single parameter, the common task: its dict made directly (dict(zip())
    # costs several times as much).
    only = names[0] if count == 1 else None

    def bind(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if not kwargs and len(args) == count:  # every argument by position
            if only is not None:
                return {only: args[0]}
            return dict(zip(names, args, strict=True))
        if len(args) > count:
            return bind_arguments(signature, args, kwargs)
        arguments = dict(zip(names, args, strict=False))  # args may be fewer
        for name, value in kwargs.items():
            if name in arguments or name not in names:
                return bind_arguments(signature, args, kwargs)
            arguments[name] = value
        if len(arguments) < count:
            for name in names:
                if name not in arguments:
                    if name not in defaults:
                        return bind_arguments(signature, args, kwargs)
                    arguments[name] = defaults[name]
        # In the signature's order, as Signature.bind gives them.
        return {name: arguments[name] for name in names}

    return bind


def call_digest(task_name: str, arguments: Mapping[str, Any], key: KeySpec) -> str:
    """The MD5 hex digest that identifies a call of ``task_name``.

    ``arguments`` are the bound arguments (the bound task itself left out).
    Raises TypeError naming the argument that cannot be serialised.
    """
    if isinstance(key, str):
        if key not in arguments:
            raise InvalidArgumentType(
                f"key={key!r} of {task_name} is not an argument of the call."
            )
        value = arguments[key]
        if isinstance(value, str):
            # The very digest the cookbook builds: md5(feed_url).hexdigest().
            return md5_hex(value)
        text = _serialise(task_name, key, value)
        if text.startswith('"'):
            # A value JSON writes as a string (UUID, datetime, Decimal, a lazy
            # str) is digested as that string, as 1 is as "1": one id for a
            # value and its text, as the cookbook's md5(str(value)) would give.
            text = json.loads(text)
        return md5_hex(text)
    if key is None and len(arguments) == 1:
        # One argument, the common call: its one part, as the general case
        # below would write it (a str in C, no list, sort or join).
        for name, value in arguments.items():
            if type(value) is str:
                return md5_hex(f"{name}={_encode_str(value)}")
            return md5_hex(f"{name}={_serialise(task_name, name, value)}")
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
        raise InvalidArgumentType(
            f"The key= callable of {task_name} returned {type(text).__name__}, not str; "
            "return a str that identifies the call."
        )
    return md5_hex(text)


def _serialise(task_name: str, name: str, value: object) -> str:
    try:
        return canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentType(
            f"single_instance cannot build the lock id of {task_name}: argument "
            f"{name!r} ({type(value).__name__}) is not JSON-serialisable ({exc}). "
            "Pass JSON-friendly values (str, numbers, lists, dicts, UUID, datetime, "
            "Decimal), or key= naming the arguments that identify a call."
        ) from exc


def check_key(
    func: Callable[..., Any], key: KeySpec, signature: inspect.Signature
) -> None:
    """Refuse a ``key=`` that names no argument of ``func``."""
    if key is None or callable(key):
        return
    names = [key] if isinstance(key, str) else key
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(name, str) for name in names)
    ):
        raise InvalidArgumentType(
            f"key= must be an argument name, a list of names or a callable, not {key!r}."
        )
    known = signature.parameters
    for name in names:
        if name not in known:
            raise InvalidArgument(
                f"key= names {name!r}, which is not an argument of {func.__qualname__}; "
                f"its arguments are: {', '.join(known) or '(none)'}."
            )
