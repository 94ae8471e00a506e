"""django.tasks on the project's database (django-tasks-db), no broker: the
worker is the backend's own ``db_worker``, run here until the queue is empty
(in this process, so that the tasklock fixture's isolation is its too)."""

import pytest
from django.core.management import call_command
from django.tasks import TaskResultStatus
from shop.jobs import close_account, send_receipt

from django_tasklock import Lock, lock_id_for

pytestmark = pytest.mark.django_db(transaction=True)


def work():
    call_command("db_worker", batch=True, startup_delay=False, reload=False)


def test_a_second_receipt_for_a_queued_order_joins_the_first(tasklock):
    first = send_receipt.enqueue(7)
    assert send_receipt.enqueue(7).id == first.id
    tasklock.assert_deduplicated(send_receipt, action="joined", times=1)
    tasklock.assert_held(lock_id_for(send_receipt, 7))  # until it has run
    work()
    first.refresh()
    assert first.status == TaskResultStatus.SUCCESSFUL
    assert first.return_value == "receipt 7"
    tasklock.assert_free(lock_id_for(send_receipt, 7))
    assert send_receipt.enqueue(7).id != first.id  # a new send, once it ran


def test_closing_an_account_being_closed_is_skipped(tasklock):
    lock_id = lock_id_for(close_account, 42)
    skipped = close_account.enqueue(42)
    with Lock(lock_id):
        work()
    skipped.refresh()
    assert skipped.status == TaskResultStatus.SUCCESSFUL
    assert skipped.return_value is None  # skipped: already running
    tasklock.assert_refused(lock_id, times=1)
    again = close_account.enqueue(42)
    work()
    again.refresh()
    assert again.return_value == "closed 42"


def test_the_lock_table_is_the_projects_own(tasklock):
    """The locks are rows of the project's database (migrate made the table),
    on the test database Django's runner made."""
    from django.db import connection

    with Lock("receipts-batch"), connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM django_tasklock_item"
            " WHERE key LIKE %s AND expires > clock_timestamp()",
            ["%receipts-batch%"],
        )
        assert cursor.fetchone() == (1,)
