"""An async view that imports a feed now, one request at a time per feed,
without blocking the event loop while it waits on the lock store.

Its lock is its own (``feeds.views.refresh-<md5 of the url>``): a fencing
token is comparable only with those of the same lock id, and the importer
refuses a write whose fence is older than the feed's last one."""

from __future__ import annotations

from hashlib import md5

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_tasklock import memcache_lock

from .tasks import _import_and_record

#: How the imports this view makes are recorded (ImportRun.task_name), and
#: what its lock ids start with.
VIEW_NAME = "example_project.feeds.views.refresh"


@csrf_exempt
@require_POST
async def refresh(request: HttpRequest) -> JsonResponse:
    """POST ``url=<feed url>``: import that feed now; 409 while another
    request imports it."""
    feed_url = request.POST.get("url", "")
    if not feed_url:
        return JsonResponse({"error": "give the feed's url"}, status=400)
    digest = md5(feed_url.encode("utf-8")).hexdigest()
    cm = memcache_lock(f"{VIEW_NAME}-{digest}", "web")
    async with cm as acquired:
        if not acquired:
            return JsonResponse({"status": "busy", "url": feed_url}, status=409)
        fence = await cm.lock.afence()
        # The import itself (HTTP fetch, parsing, the ORM) is blocking work:
        # an executor thread's (not the one thread Django's sync middleware
        # shares, where it would queue every other request behind it), while
        # the lock is the loop's.
        importing = sync_to_async(_import_and_record, thread_sensitive=False)
        url = await importing(feed_url, VIEW_NAME, fence)
    return JsonResponse({"status": "imported", "url": url})
