"""The stores (``django_tasklock.backends``): what every flavour must keep, whatever fails."""
