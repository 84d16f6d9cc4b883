"""The web console driven in a real headless Chromium (Debian's chromium and
chromium-driver, installed by scripts/browser.sh) through Selenium: pages
render, a form posts with its CSRF token, and screenshots of the overview,
schedules and job pages land in a temporary folder."""

from __future__ import annotations

import contextlib
import datetime as dt
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from celery_sched.client import Client
from celery_sched.settings import Settings
from celery_sched.web.app import create_app
from tests.integration import cli_app
from tests.integration.test_cli_jobs import make_dead

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def serving(client: Client) -> Iterator[str]:
    """The console on a free loopback port in a thread; yields its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = uvicorn.Server(
        uvicorn.Config(create_app(client), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the console did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def seed_demo(client: Client) -> None:
    """A few schedules and jobs of every kind the pages show."""
    client.schedules.add(
        "morning-report", task="cli_app.ping", schedule="0 7 * * 1-5", timezone="Europe/Paris"
    )
    client.schedules.add("heartbeat", task="cli_app.ping", schedule=60.0)
    now = client.store.now()
    client.schedule_many(
        {
            "task": "cli_app.ping",
            "eta": now + dt.timedelta(minutes=i),
            "key": f"invoice/{i:04d}",
            "args": [i],
        }
        for i in range(40)
    )
    make_dead(client, ["invoice/dead-1", "invoice/dead-2"])
    # Jobs due over the last hour, dispatched now: the overview's charts have bars.
    client.schedule_many(
        {
            "task": "cli_app.ping",
            "eta": now - dt.timedelta(minutes=i, seconds=j),
            "key": f"sync/{i}-{j}",
        }
        for i in range(1, 55, 3)
        for j in range(1 + i % 4)
    )
    store = client.store
    store.claim_due(shard=0, epoch=store.current_epoch(0), limit=1000)


def chrome() -> object:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    # The console's log: a Content-Security-Policy refusal shows there.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    assert binary and driver_path, "chromium and chromium-driver are missing: scripts/browser.sh"
    options.binary_location = binary
    return webdriver.Chrome(service=Service(driver_path), options=options)


def take_screenshots(base: str, folder: Path) -> list[Path]:
    """Drive the console and save overview, schedules and job pages in ``folder``."""
    from selenium.webdriver.common.by import By

    driver = chrome()
    shots: list[Path] = []
    try:
        driver.get(base + "/")  # type: ignore[attr-defined]
        assert driver.find_element(By.ID, "leaders")  # type: ignore[attr-defined]
        # The stylesheet applies under the console's Content-Security-Policy.
        header = driver.find_element(By.TAG_NAME, "header")  # type: ignore[attr-defined]
        assert header.value_of_css_property("background-color") == "rgba(31, 59, 90, 1)"
        assert driver.find_elements(By.CSS_SELECTOR, "svg.chart")  # type: ignore[attr-defined]
        shots.append(folder / "overview.png")
        driver.save_screenshot(str(shots[-1]))  # type: ignore[attr-defined]

        driver.get(base + "/schedules")  # type: ignore[attr-defined]
        assert "at 07:00 on weekdays, Europe/Paris" in driver.page_source  # type: ignore[attr-defined]
        shots.append(folder / "schedules.png")
        driver.save_screenshot(str(shots[-1]))  # type: ignore[attr-defined]

        driver.get(base + "/jobs?prefix=invoice/")  # type: ignore[attr-defined]
        rows = driver.find_elements(By.CSS_SELECTOR, "#jobs tr")  # type: ignore[attr-defined]
        assert len(rows) > 40
        shots.append(folder / "jobs.png")
        driver.save_screenshot(str(shots[-1]))  # type: ignore[attr-defined]

        driver.get(base + "/jobs/invoice/dead-1")  # type: ignore[attr-defined]
        assert "dead" in driver.find_element(By.ID, "job").text  # type: ignore[attr-defined]
        shots.append(folder / "job.png")
        driver.save_screenshot(str(shots[-1]))  # type: ignore[attr-defined]
    finally:
        driver.quit()  # type: ignore[attr-defined]
    return shots


def wait_text(driver: object, element_id: str, text: str) -> None:
    """Wait for the page a click loads to show ``text`` in element ``element_id``."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(
        driver,  # type: ignore[arg-type]
        10,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    ).until(lambda d: text in d.find_element(By.ID, element_id).text)


def test_the_console_in_headless_chromium(settings: Settings, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    with Client(cli_app.app, settings=settings) as client:
        client.migrate()
        seed_demo(client)
        with serving(client) as base:
            shots = take_screenshots(base, tmp_path)
            for shot in shots:
                assert shot.stat().st_size > 5000, f"{shot.name} looks empty"
                assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

            # A real form post, CSRF token and cookie included: pause, then
            # the page says so and the store agrees.
            driver = chrome()
            try:
                driver.get(base + "/schedules/heartbeat")  # type: ignore[attr-defined]
                driver.find_element(  # type: ignore[attr-defined]
                    By.XPATH, "//button[text()='Pause']"
                ).click()
                wait_text(driver, "schedule", "paused")
                # A cron typo shows next to its field; nothing changes.
                field = driver.find_element(By.NAME, "schedule")  # type: ignore[attr-defined]
                field.clear()
                field.send_keys("0 7 * *")
                driver.find_element(By.XPATH, "//button[text()='Save']").click()  # type: ignore[attr-defined]
                wait_text(driver, "error-schedule", "0 7 * *")
                driver.get(base + "/jobs/invoice/dead-2")  # type: ignore[attr-defined]
                driver.find_element(By.XPATH, "//button[text()='Requeue']").click()  # type: ignore[attr-defined]
                wait_text(driver, "job", "pending")
                refused = [
                    entry["message"]
                    for entry in driver.get_log("browser")  # type: ignore[attr-defined]
                    if "Content Security Policy" in entry["message"]
                ]
                assert refused == [], refused
            finally:
                driver.quit()  # type: ignore[attr-defined]
        info = client.schedules.get("heartbeat")
        assert info is not None and info.paused and info.spec["seconds"] == 60.0
        job = client.get("invoice/dead-2")
        assert job is not None and job.status.value == "pending"
