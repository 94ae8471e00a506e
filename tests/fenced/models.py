"""Models the fenced-write tests write: one fence field; two, for a row two
locks write; a unique pair to upsert by."""

from __future__ import annotations

from typing import ClassVar

from django.db import models

from django_tasklock.fenced import FencedQuerySet, FenceField


class Register(models.Model):
    """One value, written by whoever holds the lock of its name."""

    name = models.CharField(max_length=100, unique=True)
    value = models.BigIntegerField(default=0)
    note = models.CharField(max_length=100, blank=True)
    changed = models.DateTimeField(auto_now=True)
    fence = FenceField()

    objects: ClassVar[FencedQuerySet[Register]] = FencedQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        app_label = "fenced"


class Shared(models.Model):
    """A row two locks write: a per-row import and a nightly sweep."""

    shop = models.CharField(max_length=50)
    sku = models.CharField(max_length=50)
    stock = models.IntegerField(default=0)
    price = models.IntegerField(default=0)
    fence = FenceField()
    sweep_fence = FenceField(lock="sweep")

    objects: ClassVar[FencedQuerySet[Shared]] = FencedQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        app_label = "fenced"
        unique_together = [("shop", "sku")]


class RegisterWrite(models.Model):
    """A write a ``Register`` took, in the order the database took them (the
    randomized checker's fenced register: its history)."""

    register = models.CharField(max_length=100)
    fence = models.BigIntegerField()
    client = models.CharField(max_length=100)

    class Meta:
        app_label = "fenced"
