"""Valgrind's client requests, made from Python.

A program asks the valgrind it runs under for something by executing a
special sequence of machine instructions (``valgrind.h``'s "client
requests"): four rotations of ``rdi`` that add up to two full turns, then
``xchg rbx, rbx``, with a pointer to the request's six words in ``rax``; the
answer comes back in ``rdx``. Natively the sequence changes nothing and
answers 0. Python cannot emit it, so it is written here into a page of
executable memory and called through ctypes.

The instruction-count benchmark (``benchmarks/cpu.py``) runs its probe with
callgrind's instrumentation off (``--instr-atstart=no``) and turns it on
through ``start_instrumentation()`` once start-up is done: Python and Django
starting under full instrumentation took most of the smoke run's CPU, and
none of it was counted.

amd64 (x86-64) Linux only, where this project's benchmarks run; elsewhere
``start_instrumentation`` raises.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
from typing import Any

_AMD64 = bytes.fromhex(
    " ".join(
        [
            "48 89 f8",  # mov rax, rdi: the request's words
            "31 d2",  # xor edx, edx: the answer natively, 0
            "48 c1 c7 03",  # rol rdi, 3 (the preamble: 128 bits of rotation
            "48 c1 c7 0d",  # rol rdi, 13  in all, so that rdi is left as
            "48 c1 c7 3d",  # rol rdi, 61  it was)
            "48 c1 c7 33",  # rol rdi, 51
            "48 87 db",  # xchg rbx, rbx: the request
            "48 89 d0",  # mov rax, rdx: the answer, returned
            "c3",  # ret
        ]
    )
)
#: valgrind.h: VG_USERREQ_TOOL_BASE('C', 'T') + 4, callgrind's
#: CALLGRIND_START_INSTRUMENTATION.
START_INSTRUMENTATION = (ord("C") << 24 | ord("T") << 16) + 4
#: valgrind.h: VG_USERREQ__RUNNING_ON_VALGRIND (the core's, any tool).
RUNNING_ON_VALGRIND = 0x1001

_request: Any = None
_page: mmap.mmap | None = None


def client_request(code: int, *arguments: int) -> int:
    """Send request ``code`` with up to five ``arguments``; valgrind's answer
    (0 when not under valgrind)."""
    global _request, _page
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(
            f"valgrind client requests are written for amd64, not {platform.machine()}"
        )
    if len(arguments) > 5:
        raise ValueError("a client request takes at most five arguments")
    if _request is None:
        page = mmap.mmap(
            -1,
            mmap.PAGESIZE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC,
        )
        page.write(_AMD64)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        prototype = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64))
        _request, _page = prototype(address), page
    words = (ctypes.c_uint64 * 6)(code, *arguments, *[0] * (5 - len(arguments)))
    return int(_request(words))


def running_on_valgrind() -> int:
    """How many valgrinds deep this process runs: 0 natively."""
    return client_request(RUNNING_ON_VALGRIND)


def start_instrumentation() -> None:
    """Callgrind counts from here on (a no-op natively)."""
    client_request(START_INSTRUMENTATION)
