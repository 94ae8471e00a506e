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
