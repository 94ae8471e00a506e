from __future__ import annotations

from django.contrib import admin
from django.urls import path

from django_tasklock.metrics import metrics_view
from example_project.feeds.views import refresh

# The admin has the lock console (Task locks > Held locks); the metrics are for
# Prometheus's scraper (the demo prints both addresses).
urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics/tasklock", metrics_view),
    # An async view: import a feed now, under the import_feed task's lock.
    path("feeds/refresh", refresh),
]
