"""Headless Chromium on the dashboard, for its browser tests, its benchmark and its screenshot.

Debian's ``chromium`` and ``chromium-driver`` (scripts/install_browser.sh), driven by selenium.
Started with the flags a closed network and a root user need: no sandbox, no GPU, no background
networking, component updates or sync (each of which would try to reach Google's hosts).

    from headless_chromium import chromium, log_in
    driver = chromium()
    log_in(driver, "http://127.0.0.1:8000", key)   # the page drawing its first snapshot
"""

from __future__ import annotations

import shutil

#: Chromium's flags (see the module docstring).
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions")


def chromium(width: int = 1400, height: int = 1000, browser_log: bool = True):
    """A selenium Chrome driver on headless Chromium, its window ``width`` x ``height`` pixels.

    Raises:
        FileNotFoundError: chromium or chromedriver is not on PATH.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        raise FileNotFoundError("Chromium and ChromeDriver are not installed: run scripts/install_browser.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (*FLAGS, f"--window-size={width},{height}"):
        options.add_argument(arg)
    if browser_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver), options=options)
    d.set_page_load_timeout(60)
    return d


def snapshot_number(driver) -> int:
    """The number of the snapshot the page drew last (0: none yet)."""
    return int(driver.execute_script("return +document.body.dataset.seq || 0"))


def log_in(driver, url: str, key: str, timeout: float = 60, wait: bool = True) -> None:
    """Open ``url``/dashboard, log in with ``key`` through the page's form, and (``wait``) wait until
    it drew a snapshot.

    Raises:
        selenium.common.TimeoutException: the form or the first snapshot did not come in ``timeout`` s.
    """
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{url}/dashboard")
    WebDriverWait(driver, timeout).until(lambda d: d.find_element(By.ID, "key").is_displayed())
    field = driver.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "login-button").click()
    if wait:
        WebDriverWait(driver, timeout).until(lambda d: snapshot_number(d) > 0)
