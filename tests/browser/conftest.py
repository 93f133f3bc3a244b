"""The browser tests' marker and opt-in (deselected unless asked for), and their browser.

Opt in with `./course test --browser`, GRPO_LAB_BROWSER=1, or `pytest -m browser`.
`browser`: the system's Chromium under Playwright (chromium.py), one per test module.

Each notebook runs once per session: one that test_browser.py runs with Run All in
JupyterLab is not also run under nbval when the browser test is on. The browser's verdict
holds what nbval's does (every cell ran, in order, in a fresh kernel, and none raised; Run
All stops at the first error, so a failed assert leaves the later cells unrun), and more.
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
        run_in_browser = {item.callspec.params["notebook"] for item in items
                          if getattr(item, "originalname", "") == "test_run_all_in_jupyterlab"}
        twice = [item for item in items if item.nodeid.split("::")[0] in run_in_browser]
        if twice:
            items[:] = [item for item in items if item not in twice]
            config.hook.pytest_deselected(items=twice)
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
