"""The system's Chromium under Playwright, shared by the browser tests.

Debian's `chromium` package (or CHROMIUM=/path); never Playwright's own downloaded browsers.
Headless (Playwright's default), no sandbox (containers, root), nothing fetched in the
background, a fresh profile each launch.
"""

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def require_chromium() -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set CHROMIUM)")


def launch(playwright):
    """A headless Chromium browser (close it when done)."""
    require_chromium()
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
