import pytest
from shop.tasks import call_partner_api, rebuild_invoice, sync_account

from django_tasklock import Lock, RateLimited, lock_id_for


def test_a_second_rebuild_while_one_runs_joins_it(tasklock, run):
    first = rebuild_invoice.delay(7, again=True)
    assert first.get(timeout=30) == first.id  # the second call got its id
    tasklock.assert_deduplicated(rebuild_invoice, action="joined", times=1)
    tasklock.assert_free(lock_id_for(rebuild_invoice, 7))


def test_a_sync_of_an_account_being_synced_is_refused(tasklock, run):
    lock_id = lock_id_for(sync_account, 42)
    with Lock(lock_id):
        assert run(sync_account, 42) is None  # skipped: already running
    tasklock.assert_refused(lock_id, times=1)
    assert run(sync_account, 42) == "synced 42"


def test_the_partner_api_is_called_twice_an_hour(tasklock, run):
    assert run(call_partner_api, 1) == "sent 1"
    assert run(call_partner_api, 2) == "sent 2"
    with pytest.raises(RateLimited) as refused:
        run(call_partner_api, 3)
    tasklock.assert_rate_limited(times=1)
    tasklock.advance(refused.value.retry_after)
    assert run(call_partner_api, 3) == "sent 3"
