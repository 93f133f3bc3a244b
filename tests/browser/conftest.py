"""The browser tests' marker and opt-in (deselected unless asked for), and their browser.

Opt in with `./course test --browser`, GRPO_LAB_BROWSER=1, or `pytest -m browser`.
`browser`: the system's Chromium under Playwright (chromium.py), one per test module.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the course_lab helper
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/browser/: the chromium helper

import chromium  # noqa: E402

OPT_IN = "./course test --browser (or GRPO_LAB_BROWSER=1)"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"browser: drives JupyterLab or the course website in Chromium; opt-in: {OPT_IN}"
    )


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRPO_LAB_BROWSER") == "1" or config.option.markexpr == "browser":
        return
    skip = pytest.mark.skip(reason=f"browser test is opt-in: {OPT_IN}")
    for item in items:
        if item.get_closest_marker("browser"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = chromium.launch(playwright)
        yield launched
        launched.close()
