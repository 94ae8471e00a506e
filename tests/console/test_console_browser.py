"""The lock console in a real browser (headless Chromium, driven by Selenium, as
Django's own admin tests are), against locks held by a real ``celery worker``.

Screenshots go to ``.artifacts/`` (or ``$TASKLOCK_TEST_ARTIFACTS``), never to
git; docs/_static/console.png is one of them, committed once.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from django_tasklock import lock_id_for
from django_tasklock.status import lock_status
from tests import tasks
from tests.helpers import ROOT, wait_until
from tests.workers import start_workers, stop_workers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ARTIFACTS = Path(os.environ.get("TASKLOCK_TEST_ARTIFACTS", ROOT / ".artifacts"))
CONSOLE = "/admin/django_tasklock/heldlock/"
HOST = socket.gethostname()


@pytest.fixture
def workers(broker):
    """One worker, two pool processes, per test (one test kills it)."""
    processes = start_workers(broker, ["console-1"], concurrency=2)
    yield processes
    stop_workers(processes)


@pytest.fixture
def browser():
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",  # a laptop's
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def _memcached_locks(settings):
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60}
    # The page lists every lock store configured: here, as in most
    # projects, one memcached and one Redis.
    settings.CACHES = {
        alias: settings.CACHES[alias] for alias in ("default", "redis", "locmem")
    }


def log_in(browser, live_server, username, password="pw"):
    browser.get(live_server.url + "/admin/login/")
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(password)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait_until(lambda: "/admin/login/" not in browser.current_url, 30, every=0.05)


def row_of(browser, live_server, lock_id, query=""):
    """The console's row of ``lock_id``, reloading until it is listed (one
    liveness beat after the lock was taken)."""
    found = {}

    def listed():
        browser.get(f"{live_server.url}{CONSOLE}{query}")
        rows = browser.find_elements(
            By.CSS_SELECTOR, f'tr.tasklock-row[data-lock-id="{lock_id}"]'
        )
        if rows:
            found["row"] = rows[0]
        return bool(rows)

    # Each look loads the page in the browser: every 100 ms, not every 5 (a
    # look at what the browser shows asks chromedriver: every 50 ms).
    wait_until(listed, 30, every=0.1)
    return found["row"]


def cell(row, name):
    return row.find_element(By.CSS_SELECTOR, f"td.{name}").text


def started(key):
    wait_until(lambda: tasks.runs(key), 30)
    return tasks.runs(key)[0]


def screenshot(browser, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    browser.save_screenshot(str(path))
    assert path.stat().st_size > 10_000  # a page, not an empty frame
    return path


def text_of(browser, element_id):
    """The text of ``element_id`` on the page shown now ("" while a new page
    is loading)."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
    )

    try:
        return browser.find_element(By.ID, element_id).text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def fits_the_window(browser):
    """Nothing of the list is out of sight sideways: neither the page nor the
    list scrolls, and every row's release link is inside the window."""
    overflow = browser.execute_script(
        "const list = document.querySelector('.tasklock-console .results');"
        "return [document.documentElement.scrollWidth - window.innerWidth,"
        " list.scrollWidth - list.clientWidth, window.innerWidth];"
    )
    assert overflow[0] <= 0 and overflow[1] <= 0, overflow
    for link in browser.find_elements(By.CSS_SELECTOR, "a.release-link"):
        right = browser.execute_script(
            "return arguments[0].getBoundingClientRect().right;", link
        )
        assert right <= overflow[2], (right, overflow)


def test_a_workers_lock_is_listed_found_and_released(workers, browser, live_server):
    tasks.forget_runs()
    User.objects.create_superuser("admin", "admin@example.com", "pw")
    key = "console-browser"
    result = tasks.skip_when_told.delay(key)
    run = started(key)
    lock_id = lock_id_for(tasks.skip_when_told, key)
    try:
        log_in(browser, live_server, "admin")
        row = row_of(browser, live_server, lock_id)
        assert cell(row, "task") == tasks.skip_when_told.name
        assert cell(row, "args") == repr(key)
        assert cell(row, "holder") == f"{run['pid']}@{HOST}"
        assert cell(row, "task-id") == result.id
        assert cell(row, "state") == "alive"
        assert cell(row, "store") == "default"
        fits_the_window(browser)
        summary = browser.find_element(By.ID, "tasklock-summary").text
        assert summary == "1 listed, by 1 process in default.", summary
        screenshot(browser, "console.png")

        # Search by the task id finds it, and only it.
        search = browser.find_element(By.ID, "tasklock-search")
        search.clear()
        search.send_keys(result.id)
        browser.find_element(
            By.CSS_SELECTOR, "#tasklock-filters input[type=submit]"
        ).click()
        wait_until(lambda: f"q={result.id}" in browser.current_url, 30, every=0.05)
        rows = browser.find_elements(By.CSS_SELECTOR, "tr.tasklock-row")
        assert [r.get_attribute("data-lock-id") for r in rows] == [lock_id]

        # A live holder: refused until "Release anyway" is ticked.
        rows[0].find_element(By.CSS_SELECTOR, "a.release-link").click()
        assert "Its holder may still run" in browser.page_source
        browser.find_element(By.ID, "tasklock-release").click()
        # (Read again until the answer to the POST is the page shown.)
        wait_until(
            lambda: "Release anyway" in text_of(browser, "tasklock-refusal"),
            30,
            every=0.05,
        )
        assert lock_status(lock_id).held
        screenshot(browser, "console-release.png")
        browser.find_element(By.ID, "tasklock-force").click()
        browser.find_element(By.ID, "tasklock-release").click()
        wait_until(lambda: "Released lock" in browser.page_source, 30, every=0.05)
        assert not lock_status(lock_id).held
    finally:
        tasks.let_go(key)
    result.get(timeout=60)


def test_a_user_without_the_permission_is_refused(workers, browser, live_server):
    tasks.forget_runs()
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_heldlock"))
    User.objects.create_user("staff", password="pw", is_staff=True)
    key = "console-viewer"
    result = tasks.skip_when_told.delay(key)
    started(key)
    lock_id = lock_id_for(tasks.skip_when_told, key)
    try:
        log_in(browser, live_server, "viewer")
        row = row_of(browser, live_server, lock_id)
        assert not row.find_elements(By.CSS_SELECTOR, "a.release-link")
        browser.get(
            f"{live_server.url}{CONSOLE}release/?alias=default&lock_id={lock_id}"
        )
        assert "403" in browser.title or "Forbidden" in browser.page_source
        assert lock_status(lock_id).held
        browser.delete_all_cookies()
        log_in(browser, live_server, "staff")
        browser.get(live_server.url + CONSOLE)
        assert "403" in browser.title or "Forbidden" in browser.page_source
    finally:
        tasks.let_go(key)
    result.get(timeout=60)


def test_a_killed_workers_lock_shows_its_holder_dead(workers, browser, live_server):
    tasks.forget_runs()
    User.objects.create_superuser("admin", "admin@example.com", "pw")
    key = "console-dead"
    tasks.hold_long_when_told.delay(key)
    run = started(key)
    lock_id = lock_id_for(tasks.hold_long_when_told, key)
    log_in(browser, live_server, "admin")
    assert cell(row_of(browser, live_server, lock_id), "state") == "alive"
    # The whole worker, parent first (nobody is left to free the lock).
    for pid in (workers[0].pid, run["pid"]):
        os.kill(pid, signal.SIGKILL)
    workers[0].wait(timeout=30)
    deadline = time.monotonic() + 30
    while cell(row_of(browser, live_server, lock_id), "state") != "dead":
        assert time.monotonic() < deadline, "the killed holder never showed dead"
        time.sleep(0.2)
    screenshot(browser, "console-dead.png")
    row_of(browser, live_server, lock_id).find_element(
        By.CSS_SELECTOR, "a.release-link"
    ).click()
    assert "Its holder is gone" in browser.page_source
    assert not browser.find_elements(By.ID, "tasklock-force")
    browser.find_element(By.ID, "tasklock-release").click()
    wait_until(lambda: "its holder was gone" in browser.page_source, 30, every=0.05)
    assert not lock_status(lock_id).held
