"""No tables: one unmanaged model, so that the admin's lock console has a place
in the admin and its permissions (``view_heldlock`` to see held locks,
``delete_heldlock`` to release them) can be granted like any other."""

from __future__ import annotations

from django.db import models

__all__ = ["HeldLock"]


class HeldLock(models.Model):
    """A lock, semaphore slot or queued call some process holds (see
    ``django_tasklock.console``); never stored in the database."""

    lock_id = models.CharField(primary_key=True, max_length=250)

    class Meta:
        managed = False
        default_permissions = ("view", "delete")
        verbose_name = "held lock"
        verbose_name_plural = "held locks"

    def __str__(self) -> str:
        return self.lock_id
