"""Parked calls in the fault checker: a client's steps of
``on_contention="park"``'s line (``django_tasklock.parking``), with a broker
of the checker's own, so that the nemesis's faults meet the line too.

A call is made (``call``), delivered: its lock taken and the line asked
(``ParkLine.start``), run (a hold as any other client's, its ``start`` line
naming the call) or parked (``parked``, with its ticket; ``refused``,
``dropped`` as the full line says). A run's end, and every client's sweep
each second, promote the heads of the line (``promoted``): the broker is a
directory of message files, one per promotion, which an idle client claims
by renaming it (only one rename succeeds) and then delivers. A client killed
after its claim loses that message, as a worker that took a message with
``acks_late`` off would: the line keeps the call promoted, and after
``PROMOTE_GRACE`` a sweep sends it again.

At the end, a drain client (the nemesis stopped) sweeps and delivers until
no call is parked, then writes down what each line still holds (``line``).
The verdict (``reliability.checker``): a call that ran twice, or a call that
parked and then neither ran, nor was told (refused, dropped, an error), nor
is still in its line, is a violation.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reliability.checker_client import witness

if TYPE_CHECKING:
    import random
    from collections.abc import Callable

#: How many calls a line holds before it is full, and who leaves then.
PARK = 4
FULL = ("refuse", "drop_oldest", "replace")
#: How often a client sweeps its lines (as a worker's sweep does).
SWEEP_EVERY = 1.0


class Calls:
    """One checker client's parked calls."""

    def __init__(
        self,
        config: dict[str, Any],
        chance: random.Random,
        hold: Callable[[Any, str], None],
    ) -> None:
        self.config, self.chance, self.hold = config, chance, hold
        self.client, self.path = config["client"], config["witness"]
        self.queue = Path(config["witness"]).with_name("queue")
        self.queue.mkdir(exist_ok=True)
        self.made = 0
        self.swept = 0.0

    def _line(self, lock_id: str) -> Any:
        from django_tasklock.parking import ParkLine

        return ParkLine(lock_id, None, 600)

    def _say(self, event: str, call_id: str, lock_id: str, **more: Any) -> None:
        record = {"e": event, "call": call_id, "id": lock_id, "c": self.client}
        witness(self.path, {**record, "t": time.monotonic(), **more})

    # -- a client's steps -----------------------------------------------------------

    def step(self, lock_id: str) -> None:
        """Sweep when due, then deliver a queued call or make a new one."""
        from django_tasklock import LockBackendError

        if time.monotonic() - self.swept > SWEEP_EVERY:
            self.swept = time.monotonic()
            for swept in self.config["ids"]:
                # (failing: the next sweep, or another client's)
                with contextlib.suppress(LockBackendError):
                    self.sweep(swept)
        claimed = self.claim() if self.chance.random() < 0.6 else None
        if claimed is not None:
            self.deliver(*claimed)
            return
        self.made += 1
        call_id = f"{self.client}-{self.made}"
        self._say("call", call_id, lock_id)
        self.deliver(call_id, lock_id)

    def sweep(self, lock_id: str) -> None:
        self._line(lock_id).sweep(1, lambda call_id, _m: self.send(lock_id, call_id))

    def send(self, lock_id: str, call_id: str) -> None:
        """Put a promoted call on the broker: a file, written whole first."""
        name = f"{call_id}.{secrets.token_hex(4)}"
        draft = self.queue / f".{name}"
        draft.write_text(json.dumps([lock_id, call_id]))
        os.rename(draft, self.queue / name)
        self._say("promoted", call_id, lock_id)

    def claim(self) -> tuple[str, str] | None:
        """A message of the broker, claimed by this client (renamed away):
        its call id and lock id."""
        waiting = sorted(p for p in self.queue.iterdir() if not p.name.startswith("."))
        self.chance.shuffle(waiting)
        for message in waiting:
            mine = message.with_name(f".{self.client}-{message.name}")
            try:
                os.rename(message, mine)
            except FileNotFoundError:
                continue  # another client's claim
            lock_id, call_id = json.loads(mine.read_text())
            mine.unlink()
            return call_id, lock_id
        return None

    def deliver(self, call_id: str, lock_id: str) -> None:
        """What a worker does with a call of a parking task."""
        from django_tasklock import Lock, LockBackendError
        from django_tasklock.parking import Verdict

        line = self._line(lock_id)
        lock = Lock(lock_id, expire=self.chance.choice([3, 4, 6]), renew=True)
        try:
            if not lock.acquire():
                self.park(line, call_id, lock_id)
                return
            verdict = line.start(call_id, str(lock.token), line.alive(1))
        except LockBackendError as exc:
            lock.release_quietly()
            self._say("error", call_id, lock_id, why=str(exc)[:200])
            return
        if verdict == Verdict.RUN:
            self.hold(lock, call_id)
            try:
                _ours, waiting = line.ended(call_id)
                line.forget_message(call_id)
                if waiting:
                    line.kick(1, lambda c, _m: self.send(lock_id, c))
            except LockBackendError:
                pass  # the sweeps promote, and end it once its slot is not its
            return
        lock.release_quietly()
        if verdict == Verdict.DROP:
            self._say("copy", call_id, lock_id)
            return
        try:
            self.park(line, call_id, lock_id)
        except LockBackendError as exc:
            self._say("error", call_id, lock_id, why=str(exc)[:200])

    def park(self, line: Any, call_id: str, lock_id: str) -> None:
        at_head = call_id in line.read().promoted
        line.keep_message(call_id, json.dumps([lock_id, call_id]))
        parked = line.park(call_id, PARK, self.chance.choice(FULL), at_head)
        if parked is None:
            self._say("copy", call_id, lock_id)
            return
        left, ticket = parked
        if left == call_id:
            self._say("refused", call_id, lock_id)
            return
        self._say("parked", call_id, lock_id, ticket=ticket, head=at_head)
        if left:
            line.forget_message(left)
            self._say("dropped", left, lock_id, by=call_id)
        line.kick(1, lambda c, _m: self.send(lock_id, c))

    # -- the end --------------------------------------------------------------------

    def drain(self, deadline: float) -> None:
        """Sweep and deliver until no line has a call parked or queued (or
        the time is up); then write down what each line still holds."""
        from django_tasklock import LockBackendError

        while time.monotonic() < deadline:
            try:
                for lock_id in self.config["ids"]:
                    self.sweep(lock_id)
                claimed = self.claim()
                if claimed is not None:
                    self.deliver(*claimed)
                    continue
                lines = [self._line(i).read() for i in self.config["ids"]]
            except LockBackendError:
                time.sleep(0.2)
                continue
            if not any(line.parked for line in lines):
                break
            time.sleep(0.1)
        for lock_id in self.config["ids"]:
            line = self._line(lock_id).read()
            record = {"parked": line.ids(), "promoted": sorted(line.promoted)}
            witness(self.path, {"e": "line", "id": lock_id, **record})
