"""``manage.py tasklock``: see a lock, clear a stale one, print a call's lock id.

::

    manage.py tasklock status <lock id>
    manage.py tasklock status <semaphore name> --limit 3
    manage.py tasklock status --task feeds.import_feed https://example.com/rss
    manage.py tasklock release <lock id> [--force]
    manage.py tasklock key --task feeds.import_feed https://example.com/rss
    manage.py tasklock rate partner-api [--rate 10/m] [--pause 30 | --reset]
    manage.py tasklock leaders [<name>] [--json]

Task arguments are read as JSON where they parse as JSON (``42``, ``true``,
``[1, 2]``, ``'"42"'`` for the string) and as plain strings otherwise; keyword
arguments are ``--kwarg name=value``. ``--task`` takes a registered Celery task
name or the dotted path of a task or function.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.module_loading import import_string

from ...console import LeaderRow, leaders, take_inventory
from ...exceptions import LockBackendError, LockConfigurationError
from ...integrations.celery.lookup import registered_task, registered_tasks
from ...modes import MODES, Mode
from ...status import (
    LockStatus,
    expiry_text,
    holder_text,
    lock_status,
    park_status,
    release_refusal,
    remove,
    semaphore_status,
)
from ...targets import lock_cache_for, lock_id_for, lock_mode_for
from ..rates import add_rate_parser, rate_action


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_single_instance(target: Any) -> bool:
    try:
        lock_cache_for(target)
    except TypeError:
        return False
    return True


def resolve_task(name: str) -> Any:
    """The Celery task registered as ``name``, else the object at that dotted
    path; CommandError if neither is a ``@single_instance`` task."""
    target = registered_task(name)
    if target is None:
        try:
            target = import_string(name)
        except ImportError:
            known = (
                ", ".join(n for n, t in registered_tasks() if _is_single_instance(t))
                or "(none registered)"
            )
            raise CommandError(
                f"No task {name!r}: it is neither a registered Celery task nor an "
                f"importable dotted path. @single_instance Celery tasks: {known}."
            ) from None
    if not _is_single_instance(target):
        raise CommandError(
            f"{name!r} is not decorated with @single_instance, so it takes no lock "
            "id of its own; pass the lock id itself."
        )
    return target


class Command(BaseCommand):
    help = (
        "Inspect and clear django_tasklock locks: status, release (a stale lock; "
        "--force for any), key (the lock id a task call would use), rate (a rate "
        "limit's state; --pause, --reset), leaders (who leads each leadership)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="action")
        status = actions.add_parser(
            "status", help="Is a lock held, by whom, for how long; its last fence."
        )
        release = actions.add_parser(
            "release",
            help="Remove a lock whose holder on this host is gone; --force: any lock.",
        )
        key = actions.add_parser("key", help="Print the lock id a task call would use.")
        add_rate_parser(actions)
        led = actions.add_parser(
            "leaders",
            help="Who leads each leadership (Leadership, a leader beat), since "
            "when, its fence.",
        )
        led.add_argument("name", nargs="?", help="Only this leadership.")
        led.add_argument("--json", action="store_true", help="Print JSON.")
        for sub in (status, release, key):
            sub.add_argument(
                "values",
                nargs="*",
                metavar="lock_id | args",
                help="The lock id, or with --task the call's arguments.",
            )
            sub.add_argument("--task", help="A @single_instance task: name or path.")
            sub.add_argument(
                "--kwarg",
                action="append",
                default=[],
                metavar="NAME=VALUE",
                help="A keyword argument of the call (with --task).",
            )
        for sub in (status, release):
            sub.add_argument(
                "--cache", help="The CACHES alias (default: the task's, or TASKLOCK's)."
            )
        status.add_argument("--json", action="store_true", help="Print JSON.")
        status.add_argument(
            "--limit",
            type=int,
            metavar="N",
            help="The id names a Semaphore (or a task with limit=N): show its N slots.",
        )
        release.add_argument(
            "--force",
            action="store_true",
            help="Release even if the holder may still be running.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "rate":
            rate_action(self.stdout, options)
            return
        if options["action"] == "leaders":
            self._leaders(options["name"], options["json"])
            return
        lock_id, cache = self._lock_id(options)
        action = options["action"]
        if action == "key":
            self.stdout.write(lock_id)
            return
        cache = options.get("cache") or cache
        try:
            if action == "status" and options["limit"] is not None:
                held = self._semaphore(
                    lock_id, options["limit"], cache, options["json"]
                )
            elif action == "status":
                # Every lock a call of its mode holds (coalesce: its pending
                # call's too).
                held = False
                for number, the_id in enumerate(self._mode.lock_ids(lock_id)):
                    if number:
                        self.stdout.write("")
                    status = lock_status(the_id, cache=cache)
                    self._status(status, options["json"])
                    held = held or status.held
                self._park(lock_id, cache, options["json"])
            else:
                self._release(lock_id, cache, options["force"])
                return
        except (LockBackendError, LockConfigurationError) as exc:
            raise CommandError(str(exc)) from exc
        if not held:
            # Exit status 1, as grep: "status X && ..." runs only while held.
            # On the command line quietly (what it printed says so: a free
            # lock is an answer, not an error); to call_command, as an error.
            if self.from_command_line:
                sys.exit(1)
            raise CommandError(f"Lock {lock_id!r} is not held.", returncode=1)

    #: The mode of the task named (a bare lock id: one lock, while_running's).
    _mode: Mode = MODES["while_running"]
    #: Run from the command line (``run_from_argv``), not ``call_command``.
    from_command_line = False

    def run_from_argv(self, argv: list[str]) -> None:
        self.from_command_line = True
        super().run_from_argv(argv)

    def _lock_id(self, options: dict[str, Any]) -> tuple[str, str | None]:
        values: list[str] = options["values"]
        name = options["task"]
        if name is None:
            if options["action"] == "key":
                raise CommandError("key needs --task <name> and the call's arguments.")
            if len(values) != 1 or options["kwarg"]:
                raise CommandError(
                    "Give one lock id, or --task <name> with the call's arguments."
                )
            return values[0], None
        kwargs = {}
        for item in options["kwarg"]:
            field, sep, text = item.partition("=")
            if not sep or not field:
                raise CommandError(f"--kwarg takes NAME=VALUE, not {item!r}.")
            kwargs[field] = _value(text)
        target = resolve_task(name)
        self._mode = lock_mode_for(target)
        try:
            lock_id = lock_id_for(target, *map(_value, values), **kwargs)
        except TypeError as exc:
            raise CommandError(f"Arguments do not fit {name}: {exc}") from exc
        return lock_id, lock_cache_for(target)

    def _semaphore(
        self, name: str, limit: int, cache: str | None, as_json: bool
    ) -> bool:
        """Print a Semaphore's slots; True if any is held."""
        try:
            slots = semaphore_status(name, limit, cache=cache)
        except (TypeError, ValueError) as exc:
            raise CommandError(f"--limit: {exc}") from exc
        held = [slot for slot in slots if slot.held]
        if as_json:
            data = {
                "semaphore": name,
                "limit": limit,
                "held": len(held),
                "slots": [_as_json(slot) for slot in slots],
            }
            self.stdout.write(json.dumps(data, default=str))
            return bool(held)
        self.stdout.write(f"{'Semaphore:':<12}{name}")
        self.stdout.write(f"{'Held:':<12}{len(held)} of {limit} slots")
        for status in held:
            self.stdout.write("")
            self._status(status, False)
        return bool(held)

    def _park(self, lock_id: str, cache: str | None, as_json: bool) -> None:
        """Print the lock's park line, where it has one."""
        line = park_status(lock_id, cache=cache)
        if line.empty:
            return
        if as_json:
            self.stdout.write(json.dumps({"park": line.as_dict()}))
            return
        self.stdout.write("")
        self.stdout.write(f"{'Parked:':<12}{len(line.parked)} calls, oldest first")
        for call_id, waited in line.parked:
            self.stdout.write(f"{'':<12}{call_id} (parked {waited:.1f}s ago)")
        for call_id, since in line.promoted:
            self.stdout.write(f"{'Promoted:':<12}{call_id} (sent {since:.1f}s ago)")
        for call_id in line.running:
            self.stdout.write(f"{'Running:':<12}{call_id} (came through the line)")

    def _status(self, status: LockStatus, as_json: bool) -> None:
        if as_json:
            self.stdout.write(json.dumps(_as_json(status), default=str))
            return
        lines = [
            ("Lock", status.lock_id),
            ("Store", f"{status.store}, key {status.key!r}"),
            ("Held", "yes" if status.held else "no"),
        ]
        if status.held:
            lines.append(("Owner", str(status.value)))
            call = status.call
            if call is not None:
                lines.append(("Call", f"{call[0]}, task id {call[1]}"))
            lines.append(("Holder", holder_text(status)))
            lines.append(("Expires", expiry_text(status.ttl)))
        fence = (
            "none (no fencing counter: no fence was drawn, or it expired)"
            if status.fence is None
            else status.fence
        )
        lines.append(("Last fence", str(fence)))
        for label, text in lines:
            self.stdout.write(f"{label + ':':<12}{text}")

    def _leaders(self, name: str | None, as_json: bool) -> None:
        """Print who leads each leadership the rosters list (or ``name``)."""
        inventory = take_inventory()
        for alias, why in inventory.failed.items():
            self.stderr.write(f"Store {alias} could not be read: {why}")
        for why in inventory.incomplete:
            self.stderr.write(why)
        rows = leaders(inventory, name)
        if as_json:
            self.stdout.write(json.dumps([_leader_json(row) for row in rows]))
        for number, row in enumerate([] if as_json else rows):
            if number:
                self.stdout.write("")
            for label, text in _leader_lines(row):
                self.stdout.write(f"{label + ':':<12}{text}")
        if not rows and not as_json:
            self.stdout.write(
                f"Nobody leads {name!r}." if name else "No leadership is led."
            )
        if name is not None and not rows:
            raise CommandError(f"Nobody leads {name!r}.", returncode=1)

    def _release(self, lock_id: str, cache: str | None, force: bool) -> None:
        status = lock_status(lock_id, cache=cache)
        refused = release_refusal(status, force=force, how="Pass --force")
        if refused is not None:
            raise CommandError(refused)
        # The very item judged above, or nothing: a lock that changed hands since
        # it was read (a live worker took it after it expired) is left alone.
        if not remove(status):
            raise CommandError(
                f"Lock {lock_id!r} was released, expired or taken by another owner "
                "since it was read; nothing was removed. Look at its status again."
            )
        why = "stale: its holder is gone" if status.stale else "forced"
        self.stdout.write(f"Released lock {lock_id!r} held by {status.value} ({why}).")


def _since_text(since: float | None) -> str:
    if since is None:
        return "unknown (listed by an earlier holder: look again in a second)"
    when = datetime.datetime.fromtimestamp(since, tz=datetime.timezone.utc)
    ago = max(
        datetime.datetime.now(tz=datetime.timezone.utc) - when, datetime.timedelta()
    )
    return f"{when:%Y-%m-%d %H:%M:%S} UTC ({ago.total_seconds():.0f}s ago)"


def _leader_lines(row: LeaderRow) -> list[tuple[str, str]]:
    lines = [("Leadership", row.name), ("Store", row.alias)]
    if row.status is None:
        return [*lines, ("Error", row.error)]
    return [
        *lines,
        ("Leader", holder_text(row.status)),
        ("Since", _since_text(row.since)),
        ("Fence", "none" if row.fence is None else str(row.fence)),
    ]


def _leader_json(row: LeaderRow) -> dict[str, Any]:
    return {
        "leadership": row.name,
        "cache": row.alias,
        "leader": row.holder or None,
        "alive": row.alive,
        "since": row.since,
        "fence": row.fence,
        "error": row.error or None,
    }


def _as_json(status: LockStatus) -> dict[str, Any]:
    data = status.as_dict()
    data["never_expires"] = status.ttl is not None and math.isinf(status.ttl)
    if data["never_expires"]:
        data["ttl"] = None
    return data
