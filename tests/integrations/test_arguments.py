"""The hand-made binder gives exactly what ``Signature.bind`` gives, errors too."""

from __future__ import annotations

import inspect

import pytest

from django_tasklock.arguments import bind_arguments, binder


def plain(a, b=2, c="three"):
    pass


def required(a, b):
    pass


def no_parameters():
    pass


def star(a, *rest, key=None, **more):
    pass


def keyword_only(a, *, b=1):
    pass


def positional_only(a, /, b=1):
    pass


CALLS = [
    ((), {}),
    ((1,), {}),
    ((1, 5), {}),
    ((1, 5, 6), {}),
    ((1, 5, 6, 7), {}),
    ((), {"a": 1}),
    ((1,), {"c": 3}),
    ((1,), {"a": 1}),
    ((), {"b": 1}),
    ((1,), {"nope": 1}),
    ((1, 2), {"b": 2}),
    ((), {"c": 1, "a": 2, "b": 3}),
]


@pytest.mark.parametrize(
    "function", [plain, required, no_parameters, star, keyword_only, positional_only]
)
@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_binder_matches_signature_bind(function, args, kwargs):
    signature = inspect.signature(function)
    try:
        expected = bind_arguments(signature, args, kwargs)
    except TypeError as exc:
        with pytest.raises(TypeError, match=str(exc)[:20]):
            binder(signature)(args, kwargs)
        return
    got = binder(signature)(args, kwargs)
    assert got == expected
    assert list(got) == list(expected), "not in the signature's order"


# -- the canonical JSON a call's digest covers ---------------------------------------

import datetime  # noqa: E402
import decimal  # noqa: E402
import uuid  # noqa: E402

from kombu.serialization import dumps, loads  # noqa: E402

from django_tasklock import lock_id_for, single_instance  # noqa: E402
from django_tasklock.arguments import canonical_json  # noqa: E402

CANONICAL = [
    ("feed", '"feed"'),
    ("é\n", '"é\\n"'),
    (42, "42"),
    (1.5, "1.5"),
    (True, "true"),
    (None, "null"),
    ((1, [2, "3"]), '[1,[2,"3"]]'),
    ({"b": 1, "a": [None]}, '{"a":[null],"b":1}'),
    # Keys as JSON writes them, then sorted as text: "10" < "2".
    ({2: "two", 10: "ten"}, '{"10":"ten","2":"two"}'),
    (
        {1: "a", "b": 2, None: 0, False: 1, 2.5: 3},
        '{"1":"a","2.5":3,"b":2,"false":1,"null":0}',
    ),
    ([{3: {1: 0}}], '[{"3":{"1":0}}]'),
    (uuid.UUID(int=1), '"00000000-0000-0000-0000-000000000001"'),
    (decimal.Decimal("1.10"), '"1.10"'),
    (datetime.datetime(2026, 1, 2, 3, 4, 5, 678901), '"2026-01-02T03:04:05.678901"'),
    (
        datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc),
        '"2026-01-02T00:00:00Z"',
    ),
    (datetime.date(2026, 1, 2), '"2026-01-02"'),
]


@pytest.mark.parametrize(("value", "text"), CANONICAL)
def test_canonical_json_text(value, text):
    assert canonical_json(value) == text


@single_instance
def takes_anything(first, second=None):
    pass


ROUND_TRIPS = [
    ("feed", None),
    (1, 2.5),
    ((1, 2), [3, (4,)]),
    ({2: "two", 10: "ten"}, {"nested": {10: [1], 9: {1: 1}}}),
    ({1: "a", "b": 2}, {None: 1, True: 2, 1.5: 3}),
    ("x", [{"b": 1, "a": 2}]),
]
#: kombu's msgpack refuses dict keys other than str when it reads a message, so
#: such calls cannot be sent with it at all (README, Lock ids).
STR_KEYS_ONLY = {"msgpack"}


def _dict_keys(value):
    if isinstance(value, dict):
        yield from value
        for item in value.values():
            yield from _dict_keys(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _dict_keys(item)


SENDABLE = [
    (serializer, first, second)
    for serializer in ("json", "msgpack", "pickle")
    for first, second in ROUND_TRIPS
    if serializer not in STR_KEYS_ONLY
    or all(isinstance(key, str) for key in _dict_keys([first, second]))
]


@pytest.mark.parametrize(("serializer", "first", "second"), SENDABLE)
def test_one_call_has_one_id_after_any_serializers_round_trip(
    serializer, first, second
):
    """As kombu sends a task's args and reads them back in the worker."""
    before = lock_id_for(takes_anything, first, second)
    content_type, encoding, payload = dumps([first, second], serializer=serializer)
    after = loads(payload, content_type, encoding, accept=[content_type])
    assert lock_id_for(takes_anything, *after) == before


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1, 2}, "set"),
        (b"raw", "bytes"),
        ({(1, 2): "tuple key"}, "a dict key must be a str, int, float, bool or None"),
        ({1: "a", "1": "b"}, "two keys that JSON writes as '1'"),
        ({float("nan"): 1}, "'first'"),
        (float("inf"), "'first'"),
        (object(), "object"),
    ],
)
def test_unsupported_arguments_refused_naming_the_argument(value, message):
    with pytest.raises(TypeError, match="argument 'first'") as caught:
        lock_id_for(takes_anything, value)
    assert message in str(caught.value)
    assert "key=" in str(caught.value)
