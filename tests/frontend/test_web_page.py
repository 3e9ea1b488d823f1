"""The chat page in a real headless Chromium (Debian chromium + chromium-driver): connect
with a key, pick a model, send a message and watch the reply stream into the page."""

from __future__ import annotations

import shutil
import tempfile

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


# The page's newest reply, read in one go inside the page (text and state agree): the text
# of the bubble itself (the usage line the done frame adds is a child element, left out).
READ_REPLY = """
const bubbles = document.querySelectorAll(".msg.assistant");
if (!bubbles.length) return null;
const b = bubbles[bubbles.length - 1];
const text = Array.from(b.childNodes).filter((n) => n.nodeType === Node.TEXT_NODE)
  .map((n) => n.data).join("");
return {text: text, done: b.dataset.done === "true", frames: Number(b.dataset.frames || 0)};
"""


def chat_in_page(
    driver,
    url: str,
    key: str,
    model: str,
    message: str,
    timeout: float = 60,
    keep_page: bool = False,
):
    """Drive the page (connecting first unless keep_page) and follow the reply: returns
    (the first state of the reply that showed text, the final state), each a dict with
    `text`, `done` and `frames` (token frames rendered). The first is caught by a poll on
    the condition "text on the page" and may already be the done one (then the page showed
    nothing before the reply was complete)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(driver, timeout, poll_frequency=0.005)
    if not keep_page:
        driver.get(url)
        driver.find_element(By.ID, "api-key").send_keys(key)
        driver.find_element(By.ID, "connect").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "connected"))
        Select(driver.find_element(By.ID, "model")).select_by_value(model)
    count = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    driver.find_element(By.ID, "message").send_keys(message)
    driver.find_element(By.ID, "send").click()

    def reply(d):
        if len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) <= count:
            return None  # this message's bubble is not there yet
        return d.execute_script(READ_REPLY)

    first = wait.until(lambda d: (r := reply(d)) and (r["text"] or r["done"]) and r)
    final = wait.until(lambda d: (r := reply(d)) and r["done"] and r)
    return first, final


def test_reply_streams_into_the_page(server, adapter_dirs, tmp_path):
    key = server.create_tenant("browser-user")
    assert server.upload(key, "web", adapter_dirs["a"]).status_code == 201
    driver = browser()
    try:
        first, final = chat_in_page(driver, server.url + "/", key, "web", "hello there")
        # caught half-way: text on the page before the done frame, the start of the reply
        assert not first["done"], "the page showed nothing until the reply was complete"
        assert 0 < first["frames"] < final["frames"]
        assert first["text"] and final["text"].startswith(first["text"])
        assert len(first["text"]) < len(final["text"])
        # the page shows the whole reply, as the API gives it
        body = {
            "model": "web",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 256,
            "temperature": 0,
        }
        with server.http(key) as c:
            r = c.post("/v1/chat/completions", json=body)
        assert final["text"] == r.json()["choices"][0]["message"]["content"]
        meta = driver.find_elements("css selector", ".msg.assistant .meta")[-1].text
        usage = r.json()["usage"]["completion_tokens"]
        assert meta.endswith(f"{usage} tokens")  # the done frame's usage line
        options = [
            o.get_attribute("value") for o in driver.find_elements("css selector", "#model option")
        ]
        assert options == [server.model_id, "web"]
        driver.save_screenshot(str(tmp_path / "web-chat.png"))
    finally:
        driver.quit()
