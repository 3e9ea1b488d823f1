"""The chat page in a real headless Chromium (Debian chromium + chromium-driver): connect
with a key, pick a model, send a message and watch the reply stream into the page."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1100,800",
]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "the web page test needs Debian's chromium and chromium-driver "
            "(scripts/bootstrap.sh installs them): apt-get install chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}"]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def chat_in_page(
    driver,
    url: str,
    key: str,
    model: str,
    message: str,
    timeout: float = 60,
    keep_page: bool = False,
):
    """Drive the page (connecting first unless keep_page); returns (final reply element,
    token-frame counts seen while the reply streamed)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(driver, timeout)
    if not keep_page:
        driver.get(url)
        driver.find_element(By.ID, "api-key").send_keys(key)
        driver.find_element(By.ID, "connect").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "connected"))
        Select(driver.find_element(By.ID, "model")).select_by_value(model)
    driver.find_element(By.ID, "message").send_keys(message)
    driver.find_element(By.ID, "send").click()
    partial, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        bubbles = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        if bubbles:
            bubble = bubbles[-1]
            if bubble.get_attribute("data-done") == "true":
                return bubble, partial
            partial.append(int(bubble.get_attribute("data-frames") or 0))
        time.sleep(0.01)
    raise AssertionError("no complete reply in the page")


def test_reply_streams_into_the_page(server, adapter_dirs, tmp_path):
    key = server.create_tenant("browser-user")
    assert server.upload(key, "web", adapter_dirs["a"]).status_code == 201
    driver = browser()
    try:
        bubble, partial = chat_in_page(driver, server.url + "/", key, "web", "hello there")
        frames = int(bubble.get_attribute("data-frames"))
        assert frames > 1, "the reply arrived in one piece, not streamed"
        assert any(0 < p < frames for p in partial), "no intermediate state was ever rendered"
        assert "tokens" in bubble.text  # the done frame's usage line
        options = [
            o.get_attribute("value") for o in driver.find_elements("css selector", "#model option")
        ]
        assert options == [server.model_id, "web"]
        driver.save_screenshot(str(tmp_path / "web-chat.png"))
    finally:
        driver.quit()
