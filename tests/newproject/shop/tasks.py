from celery import shared_task

from django_tasklock import rate_limited, single_instance


@shared_task(bind=True)
@single_instance(mode="until_finished", key="order_id")
def rebuild_invoice(self, order_id, again=False):
    """Rebuilds an invoice; with ``again``, asks for the same rebuild while it
    runs (a second click), which must join this call, not run twice."""
    if again:
        return rebuild_invoice.delay(order_id).id
    return f"invoice {order_id}"


@shared_task
@single_instance(key="account_id")
def sync_account(account_id):
    return f"synced {account_id}"


@shared_task
@rate_limited("2/h", on_limit="raise")
def call_partner_api(order_id):
    return f"sent {order_id}"
