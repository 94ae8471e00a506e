"""Tasks of an app that runs every call eagerly (``task_always_eager``), as a
project's test settings do: one per mode and contention policy, each able to
call itself with the same lock id from inside its body (``nested``)."""

from __future__ import annotations

from typing import Any

from celery import Celery

from django_tasklock import rate_limited, single_instance

app = Celery("eager", set_as_current=False)
app.conf.update(
    broker_url="memory://",
    task_always_eager=True,
    task_eager_propagates=True,
    task_serializer="json",
    accept_content=["json"],
)

#: What each body saw, in order: (task, key, what).
ran: list[tuple[str, str, object]] = []


def _body(task: Any, key: str, nested: bool) -> object:
    """Record the run; with ``nested``, call the same task with the same lock
    id from inside, and return what that call gave or raised."""
    if not nested:
        ran.append((task.name, key, "ran"))
        return f"ran {key}"
    try:
        inner = task.delay(key)
    except Exception as exc:  # what the nested call raised, for the test
        ran.append((task.name, key, type(exc).__name__))
        return {"raised": type(exc).__name__, "message": str(exc)}
    ran.append((task.name, key, "outer"))
    return {"id": inner.id, "outer": task.request.id}


@app.task(bind=True, name="eager.skip")
@single_instance(key="key", expire=60)
def skip(self: Any, key: str, nested: bool = False) -> object:
    return _body(self, key, nested)


@app.task(bind=True, name="eager.wait")
@single_instance(key="key", expire=60, on_contention="wait", timeout=30)
def wait(self: Any, key: str, nested: bool = False) -> object:
    return _body(self, key, nested)


@app.task(bind=True, name="eager.retry")
@single_instance(key="key", expire=60, on_contention="retry", countdown=30)
def retry(self: Any, key: str, nested: bool = False) -> object:
    return _body(self, key, nested)


@app.task(bind=True, name="eager.until_finished")
@single_instance(key="key", mode="until_finished", expire=60)
def until_finished(self: Any, key: str, nested: bool = False) -> object:
    return _body(self, key, nested)


@app.task(bind=True, name="eager.until_finished_raise")
@single_instance(key="key", mode="until_finished", on_duplicate="raise", expire=60)
def until_finished_raise(self: Any, key: str, nested: bool = False) -> object:
    return _body(self, key, nested)


@app.task(bind=True, name="eager.until_started")
@single_instance(key="key", mode="until_started", expire=60)
def until_started(self: Any, key: str, nested: bool = False) -> object:
    return _body(self, key, nested)


@app.task(bind=True, name="eager.coalesce")
@single_instance(key="key", mode="coalesce", expire=60, timeout=30)
def coalesce(self: Any, key: str, nested: bool = False) -> object:
    return _body(self, key, nested)


@app.task(bind=True, name="eager.coalesce_briefly")
@single_instance(key="key", mode="coalesce", expire=60, timeout=2)
def coalesce_briefly(self: Any, key: str, nested: bool = False) -> object:
    """``coalesce`` with a wait short enough to wait out in a test."""
    return _body(self, key, nested)


@app.task(bind=True, name="eager.flaky", max_retries=3)
@single_instance(key="key", mode="until_finished", expire=60)
def flaky(self: Any, key: str, failures: int = 1) -> object:
    """Fails ``failures`` times (``self.retry()``), then returns."""
    if self.request.retries < failures:
        raise self.retry(countdown=0)
    ran.append((self.name, key, f"ran after {self.request.retries} retries"))
    return self.request.retries


@app.task(bind=True, name="eager.limited")
@rate_limited("1/h", key="key")
def limited(self: Any, key: str) -> str:
    ran.append((self.name, key, "ran"))
    return f"ran {key}"
