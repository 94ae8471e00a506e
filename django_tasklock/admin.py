"""The lock console in Django's admin: held locks, semaphore slots and queued
calls, found without scanning the cache (``console``), and released from the
page under the rules of ``manage.py tasklock release``.

Staff with ``django_tasklock.view_heldlock`` see it; releasing needs
``django_tasklock.delete_heldlock`` too, and every release is written to the
admin's log (``LogEntry``) with who released what.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Any, Final

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.http import urlencode

from .backends import close_thread_connections, thread_connections
from .conf import settings
from .console import (
    KINDS,
    LeaderRow,
    Listed,
    leaders,
    lock_aliases,
    park_lines,
    rate_limits,
    take_inventory,
)
from .exceptions import LockBackendError, TaskLockError
from .models import HeldLock
from .status import LockStatus, expiry_text, holder_text, lock_status, release_refusal
from .status import remove as remove_lock
from .values import unique_value

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.http import HttpRequest, HttpResponse
    from django.urls import URLPattern

__all__ = ["LockConsole"]

#: Rows per page.
PER_PAGE: Final = 50
_STATE = {True: "alive", False: "dead", None: "unknown"}


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "never"
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def _row(listed: Listed, now: float) -> dict[str, Any]:
    """What the console shows of one listed lock, read from its store now."""
    entry = listed.entry
    row: dict[str, Any] = {
        "listed": listed,
        "entry": entry,
        "age": _seconds(listed.age(now)),
        "release_query": urlencode({"alias": listed.alias, "lock_id": entry.lock_id}),
    }
    try:
        status = listed.status()
    except LockBackendError as exc:
        row["error"] = str(exc)
        return row
    owner, call = status.owner, status.call
    row.update(
        status=status,
        held=status.held,
        holder="—" if owner is None else f"{owner.pid}@{owner.host}",
        state="—" if owner is None else _STATE[owner.alive],
        why=holder_text(status) if status.held else "released since it was listed",
        call_state="" if call is None else call[0],
        task_id=call[1] if call is not None else (entry.call_id or ""),
        left=_seconds(status.ttl),
        fence="—" if status.fence is None else status.fence,
    )
    return row


def _leader(row: LeaderRow) -> dict[str, Any]:
    """What the console shows of one leadership."""
    return {
        "row": row,
        "state": _STATE[row.alive],
        "why": "" if row.status is None else holder_text(row.status),
        "age": "—" if row.since is None else _seconds(time.time() - row.since),
        "fence": "—" if row.fence is None else row.fence,
    }


def summary(found: int, processes: dict[str, int]) -> str:
    """The page's one sentence: what was listed, by how many processes, in
    which stores (only those where a process lists something)."""
    listing = [(alias, count) for alias, count in processes.items() if count]
    if not listing:
        return f"{found} listed: no process lists a lock in any store."
    parts = [
        f"{count} process{'es' if count != 1 else ''} in {alias}"
        for alias, count in listing
    ]
    stores = (
        parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    )
    return f"{found} listed, by {stores}."


@admin.register(HeldLock)
class LockConsole(admin.ModelAdmin):  # type: ignore[type-arg]
    """The held-lock list and the release confirmation, in place of the
    model's (it has no table)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}"

        def view(function: Callable[[HttpRequest], HttpResponse]) -> Any:
            @functools.wraps(function)
            def closing(request: HttpRequest) -> HttpResponse:
                # The stores are read through this thread's own lock
                # connections, which Django's close_caches() leaves open: those
                # this request opened are closed with it (a web server's
                # threads may not live long); a thread's earlier ones are kept.
                fresh = not thread_connections()
                try:
                    return function(request)
                finally:
                    if fresh:
                        close_thread_connections()

            return self.admin_site.admin_view(closing)

        return [
            path("", view(self.changelist_view), name=f"{name}_changelist"),
            path("release/", view(self.release_view), name=f"{name}_release"),
        ]

    def _context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "has_view_permission": True,
        }

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, str] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        query = request.GET
        inventory = take_inventory()
        chosen = {
            "task": query.get("task", ""),
            "alias": query.get("alias", ""),
            "kind": query.get("kind", ""),
            "q": query.get("q", ""),
        }
        found = inventory.select(
            task=chosen["task"],
            alias=chosen["alias"],
            kind=chosen["kind"],
            search=chosen["q"],
        )
        page = Paginator(found, PER_PAGE).get_page(query.get("p"))
        now = time.time()
        kept: dict[str, str | int] = {
            key: value for key, value in chosen.items() if value
        }
        context = {
            **self._context(request, "Held locks"),
            "inventory": inventory,
            "rows": [_row(Listed.of(found), now) for found in page.object_list],
            "page": page,
            "chosen": chosen,
            "kinds": KINDS,
            "aliases": sorted(inventory.processes) + sorted(inventory.failed),
            "summary": summary(len(found), inventory.processes),
            "page_query": {
                number: urlencode({**kept, "p": number})
                for number in page.paginator.page_range
            },
            "can_release": self.has_delete_permission(request),
            "limits": rate_limits() if page.number == 1 else [],
            "parks": park_lines() if page.number == 1 else [],
            "leaders": [_leader(row) for row in leaders(inventory)]
            if page.number == 1
            else [],
        }
        return TemplateResponse(request, "admin/django_tasklock/console.html", context)

    def release_view(self, request: HttpRequest) -> HttpResponse:
        if not (
            self.has_view_permission(request) and self.has_delete_permission(request)
        ):
            raise PermissionDenied
        source = request.POST if request.method == "POST" else request.GET
        alias, lock_id = source.get("alias", ""), source.get("lock_id", "")
        try:
            status = _console_lock(lock_id, alias or settings.CACHE)
        except LockBackendError as exc:
            messages.error(request, f"Could not read lock {lock_id!r}: {exc}")
            return HttpResponseRedirect(self._list_url())
        refusal = None
        if request.method == "POST":
            force = source.get("force") == "on"
            if source.get("seen") != str(status.value):
                refusal = (
                    f"Lock {lock_id!r} changed hands since the page was shown "
                    "(released, expired or taken); nothing was removed. Look again."
                )
            else:
                refusal = release_refusal(
                    status, force=force, how="Tick “Release anyway”"
                )
            if refusal is None:
                return self._release(request, status, force)
        context = {
            **self._context(request, "Release a lock"),
            "status": status,
            "alias": alias,
            "holder": holder_text(status) if status.held else "",
            "expires": expiry_text(status.ttl),
            "refusal": refusal,
            "needs_force": release_refusal(status, force=False, how="") is not None,
            "list_url": self._list_url(),
        }
        return TemplateResponse(request, "admin/django_tasklock/release.html", context)

    def _release(
        self, request: HttpRequest, status: LockStatus, force: bool
    ) -> HttpResponse:
        # The very item judged, or nothing (a lock that changed hands since).
        if not remove_lock(status):
            messages.error(
                request,
                f"Lock {status.lock_id!r} was released, expired or taken by another "
                "owner since it was read; nothing was removed.",
            )
            return HttpResponseRedirect(self._list_url())
        why = "its holder was gone" if status.stale else "forced"
        LogEntry.objects.create(
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(
                HeldLock, for_concrete_model=False
            ).pk,
            object_id=f"{status.cache or ''}:{status.lock_id}"[:250],
            object_repr=status.lock_id[:200],
            action_flag=DELETION,
            change_message=(
                f"Released lock {status.lock_id} in {status.store} ({why}); "
                f"it was held by {status.value}."
            ),
        )
        messages.success(
            request,
            f"Released lock {status.lock_id!r} ({why}): held by {status.value}.",
        )
        return HttpResponseRedirect(self._list_url())

    def _list_url(self) -> str:
        return reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}"
            "_changelist"
        )


def _console_lock(lock_id: str, alias: str) -> LockStatus:
    """The lock ``lock_id`` in lock store ``alias``, if it is one the console
    lists: a store locks are taken in, and, when held, a value this app
    stores for a lock (a token or a call's mark). Anything else is a 404, so
    the release permission never reads nor deletes other cache entries (an
    application's values, rate-limit states, liveness records, rosters).
    Raises ``LockBackendError`` when the store does not answer."""
    if alias not in lock_aliases():
        raise Http404("No lock store of that name.")
    try:
        status = lock_status(lock_id, cache=alias)
    except LockBackendError:
        raise
    except (TaskLockError, TypeError, ValueError) as exc:  # not a lock id
        raise Http404("Not a lock id.") from exc
    if status.held and not unique_value(status.value):
        raise Http404("Not a lock of django_tasklock.")
    return status
