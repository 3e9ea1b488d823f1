"""Screenshot of the web chat for the README: the default model answering in headless Chromium.

    .venv/bin/python scripts/web_chat_screenshot.py [docs/web-chat.png]

Reuses the web page test's browser driver and server fixture code."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import punica_x  # noqa: F401

# The real punica_x is imported first: tests/punica_x (no __init__) would otherwise shadow it.
ROOT = Path(__file__).resolve().parents[1]
sys.path += [str(ROOT / "tests"), str(ROOT / "tests" / "frontend")]

from live_server import start_server  # noqa: E402
from test_web_page import browser, chat_in_page  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "web-chat.png")
    server = start_server(None, Path(tempfile.mkdtemp()) / "data")  # the default model
    try:
        key = server.create_tenant("demo")
        with server.http(key) as c:
            model_id = c.get("/v1/models").json()["data"][0]["id"]
        driver = browser()
        try:
            chat_in_page(driver, server.url + "/", key, model_id, "What is the capital of France?")
            chat_in_page(
                driver,
                server.url + "/",
                key,
                model_id,
                "Write a haiku about the sea.",
                keep_page=True,
            )
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
    finally:
        server.stop()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
