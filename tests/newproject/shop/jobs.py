from django.tasks import task

from django_tasklock import single_instance


@task
@single_instance(mode="until_finished", key="order_id")
def send_receipt(order_id):
    """Mails an order's receipt: one queued or running send per order."""
    return f"receipt {order_id}"


@task
@single_instance(key="account_id")
def close_account(account_id):
    return f"closed {account_id}"
