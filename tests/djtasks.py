"""Functions for Django's own tasks framework (django.tasks, Django 6+)."""

from __future__ import annotations

from django.tasks import task

from django_tasklock import rate_limited, single_instance


@task
@single_instance
def count_words(text):
    return len(text.split())


@task(takes_context=True)
@single_instance(on_contention="raise")
def with_context(context, text):
    return (context.attempt, text)


@task
@single_instance(mode="until_finished")
def summarize(text):
    """Reports what its own lock looks like from inside the run."""
    from django_tasklock import lock_id_for
    from django_tasklock.status import lock_status

    return list(lock_status(lock_id_for(summarize, text)).call or ())


@task(takes_context=True)
@single_instance(mode="until_finished", on_duplicate="raise")
def summarize_once(context, text):
    """Enqueues itself again from inside its run: a duplicate of a running call."""
    from django_tasklock import AlreadyQueued

    try:
        summarize_once.enqueue(text)
    except AlreadyQueued as exc:
        return [context.task_result.id, exc.task_id]
    return [context.task_result.id, None]


@task
@single_instance(mode="until_finished", on_duplicate="replace")
def replaced(text):
    return text


@task
@single_instance(key="text", on_contention="wait", timeout=30)
def waits_for_itself(text, nested=False):
    """Enqueues itself from inside its run (ImmediateBackend runs it in place):
    a call that cannot wait for its own caller."""
    if not nested:
        return "ran"
    inner = waits_for_itself.enqueue(text)
    return [inner.status, [error.exception_class.__name__ for error in inner.errors]]


@task
@single_instance(key="text")
async def count_letters(text):
    """An async task: its lock is held while the worker awaits it."""
    import asyncio

    from django_tasklock import lock_id_for
    from django_tasklock.status import lock_status

    await asyncio.sleep(0)
    return [len(text), lock_status(lock_id_for(count_letters, text)).held]


@task
@rate_limited("1/10s", name="djtasks-async-limited", on_limit="skip")
async def ping_partner(n):
    return n


def _call_of(lock_id):
    from django_tasklock.status import lock_status

    return list(lock_status(lock_id).call or ())


@task
@single_instance(mode="until_finished")
async def asummarize(text):
    """An async until_finished task: what its own lock looks like inside."""
    import asyncio

    from django_tasklock import lock_id_for

    await asyncio.sleep(0)
    return _call_of(lock_id_for(asummarize, text))


@task
@single_instance(mode="until_started")
async def astarted(text):
    """An async until_started task: its call's mark and its run lock inside."""
    import asyncio

    from django_tasklock import current_lock, lock_id_for

    await asyncio.sleep(0)
    run_lock = current_lock()
    return [_call_of(lock_id_for(astarted, text)), run_lock.lock_id, run_lock.held]


@task
@single_instance(mode="coalesce")
async def acoalesced(text):
    """An async coalesce task: its pending mark and its running lock inside."""
    import asyncio

    from django_tasklock import lock_id_for
    from django_tasklock.calls import QUEUE_SUFFIX
    from django_tasklock.status import lock_status

    await asyncio.sleep(0)
    lock_id = lock_id_for(acoalesced, text)
    return [lock_status(lock_id + QUEUE_SUFFIX).held, _call_of(lock_id)]


@task
@single_instance(mode="until_finished")
async def alinger(text, seconds):
    """An async until_finished task that runs ``seconds``."""
    import asyncio

    await asyncio.sleep(seconds)
    return text
