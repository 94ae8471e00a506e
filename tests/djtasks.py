"""Functions for Django's own tasks framework (django.tasks, Django 6+)."""

from __future__ import annotations

from django.tasks import task

from django_tasklock import single_instance


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
