"""Prometheus metrics (``django_tasklock.metrics``): a storm of duplicate calls
over real prefork workers that export in prometheus_client's multiprocess
mode, and counts that must equal what the test saw published, deduplicated and
run."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, multiprocess

from django_tasklock import Lock
from django_tasklock.metrics import LockMetrics, metrics_view, task_label
from django_tasklock.status import force_release
from tests import tasks
from tests.helpers import close_connections
from tests.workers import start_workers, stop_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prometheus")


@pytest.fixture(scope="module")
def workers(broker, metrics_dir):
    """One worker, four pool processes, exporting to ``metrics_dir``."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "TASKLOCK_TEST_METRICS": "1"}
    processes = start_workers(broker, ["metrics-1"], concurrency=4, extra_env=env)
    yield processes
    stop_workers(processes)


@pytest.fixture
def producer_metrics():
    """This process's metrics (the producer's: duplicates stopped at .delay())."""
    metrics = LockMetrics(CollectorRegistry())
    metrics.connect()
    yield metrics
    metrics.disconnect()


def sample(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_a_storm_of_duplicates_counts_what_was_published_deduplicated_and_run(
    settings, workers, metrics_dir, producer_metrics
):
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60}
    tasks.forget_runs()
    keys = [f"metrics-{n}" for n in range(6)]
    ids: list[str] = []
    mutex = threading.Lock()

    def send(round_keys):
        try:
            for key in round_keys:
                result = tasks.finish_once.delay(key, seconds=0.4)
                with mutex:
                    ids.append(result.id)
        finally:
            close_connections()

    threads = [threading.Thread(target=send, args=(keys * 5,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    published = set(ids)
    deduplicated = len(ids) - len(published)
    assert deduplicated > 0 and len(published) >= len(keys)
    for task_id in published:
        tasks.finish_once.AsyncResult(task_id).get(timeout=60)
    runs = [run for key in keys for run in tasks.runs(key)]
    assert len(runs) == len(published)  # every published call ran, once

    name, cache = tasks.finish_once.name, "default"
    seen = producer_metrics.duplicates.labels(name, cache, "joined")._value.get()
    assert seen == deduplicated

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    labels = {"task": name, "cache": cache}
    assert sample(registry, "tasklock_acquisitions_total", **labels) == len(runs)
    assert sample(registry, "tasklock_wait_seconds_count", **labels) == len(runs)
    assert sample(registry, "tasklock_hold_seconds_count", **labels) == len(runs)
    held = sample(registry, "tasklock_hold_seconds_sum", **labels)
    assert held >= 0.4 * len(runs)
    # Summed across the pool's processes: runs came from several, each its file.
    pids = {run["pid"] for run in runs}
    files = {path.name for path in metrics_dir.glob("counter_*.db")}
    assert len(pids) >= 2 and {f"counter_{pid}.db" for pid in pids} <= files


def test_labels_are_task_names_never_lock_ids():
    lock = Lock("feeds.import_feed-lock-0123456789abcdef")
    assert task_label(lock, lock.lock_id) == "feeds.import_feed"
    lock.about = ("feeds.import_feed", (), {})
    assert task_label(lock, "anything") == "feeds.import_feed"
    slot = Lock("reports-17-slot-2")
    slot.slot_of = "reports-17"
    assert task_label(slot, slot.lock_id) == "(semaphore)"
    assert task_label(Lock("invoice-17"), "invoice-17") == "(lock)"


def test_series_depend_on_what_is_declared_not_on_ids_or_arguments(
    settings, producer_metrics
):
    from django_tasklock import RateLimiter, Semaphore, memcache_lock, rate_limited

    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60, "LIVENESS": None}
    for n in range(5000):
        lock = Lock(f"invoice-{n}", expire=30)
        assert lock.acquire() and lock.release()
        with memcache_lock(f"export:{n}", "oid") as acquired:
            assert acquired
    for n in range(50):
        semaphore = Semaphore(f"report-{n}", 2, expire=30)
        assert semaphore.acquire() and semaphore.release()

    @rate_limited("1/h", name="metrics-keyed", key="tenant", on_limit="skip")
    def per_tenant(tenant):
        return tenant

    try:
        for n in range(1000):
            per_tenant(n)
            per_tenant(n)  # refused: counted
        for n in range(100):
            undeclared = RateLimiter(f"user-{n}", "1/h")
            undeclared.reset()
            assert undeclared.admit() and not undeclared.admit()
            undeclared.reset()
    finally:
        from django_tasklock.limits.decorator import DECLARED

        DECLARED.pop("metrics-keyed", None)
    series = {}
    for metric in producer_metrics.registry.collect():
        names = {
            tuple(sorted(sample.labels.items()))
            for sample in metric.samples
            if not sample.name.endswith(("_created", "_bucket"))
        }
        series[metric.name] = names
    tasks = {dict(labels)["task"] for labels in series["tasklock_acquisitions"]}
    assert tasks == {"(lock)", "(semaphore)"}, tasks
    limited = series["tasklock_rate_limited"]
    assert {dict(labels)["task"] for labels in limited} == {"metrics-keyed", "(limit)"}
    total = sum(len(names) for names in series.values())
    print(f"series for 10,000 lock ids, 50 semaphores, 1,100 limit ids: {total}")
    assert total <= 20, series
    assert (
        sample(
            producer_metrics.registry,
            "tasklock_rate_limited_total",
            task="metrics-keyed",
        )
        == 1000
    )


def test_contentions_losses_and_store_errors_are_counted(settings, rf):
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60}
    metrics = LockMetrics(CollectorRegistry())
    metrics.connect()
    try:
        first, second = Lock("nightly-lock-1"), Lock("nightly-lock-1")
        assert first.acquire() and not second.acquire()
        assert (
            metrics.contentions.labels("nightly", "default", "none")._value.get() == 1
        )
        force_release("nightly-lock-1")
        assert first.release() is False
        assert metrics.lost.labels("nightly", "default", "release")._value.get() == 1
        settings.CACHES = {
            **settings.CACHES,
            "down": {
                "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
                "LOCATION": "127.0.0.1:9",
            },
        }
        with pytest.raises(Exception, match="Could not"):
            Lock("nightly-lock-2", cache="down").acquire()
        assert metrics.store_errors.labels("nightly", "down")._value.get() == 1
    finally:
        metrics.disconnect()
        close_connections()
    response = metrics_view(rf.get("/metrics"))
    assert response.status_code == 200


@pytest.mark.parametrize("value", ["statsd", True, "Prometheus"])
def test_a_bad_metrics_setting_is_a_check_error_that_says_what_to_write(
    settings, value
):
    from django.core.checks import run_checks
    from django.test import override_settings

    from django_tasklock.conf import settings as tasklock_settings
    from django_tasklock.exceptions import LockConfigurationError

    with override_settings(TASKLOCK={"METRICS": value}):
        errors = [m for m in run_checks() if m.id == "django_tasklock.E020"]
        assert errors and "None or 'prometheus'" in errors[0].msg
        with pytest.raises(LockConfigurationError, match="METRICS"):
            tasklock_settings.METRICS  # noqa: B018


def test_the_app_connects_the_metrics_when_asked(settings):
    """TASKLOCK["METRICS"] = "prometheus" connects the receivers at ready()."""
    from django.apps import apps

    from django_tasklock import metrics as metrics_module
    from django_tasklock.signals import lock_acquired

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics_module, "_installed", [LockMetrics(CollectorRegistry())])
        settings.TASKLOCK = {"CACHE": "default", "METRICS": "prometheus"}
        before = len(lock_acquired.receivers)
        apps.get_app_config("django_tasklock").ready()
        try:
            assert len(lock_acquired.receivers) == before + 1
            lock = Lock("ready-lock-1")
            assert lock.acquire() and lock.release()
            counted = metrics_module._installed[0].acquisitions
            assert counted.labels("ready", "default")._value.get() == 1
        finally:
            metrics_module._installed[0].disconnect()


def test_a_refused_call_is_counted_under_its_tasks_policy(settings):
    from django_tasklock import lock_id_for

    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60}
    metrics = LockMetrics(CollectorRegistry())
    metrics.connect()
    holder = Lock(lock_id_for(tasks.import_feed, "https://held.example/rss", seconds=0))
    try:
        assert holder.acquire()
        assert tasks.import_feed("https://held.example/rss", seconds=0) is None
        refused = metrics.contentions.labels(tasks.import_feed.name, "default", "skip")
        assert refused._value.get() == 1
    finally:
        holder.release()
        metrics.disconnect()
