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
