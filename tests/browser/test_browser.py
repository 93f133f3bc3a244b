"""JupyterLab in a real browser (issue 16): what a learner sees after Run All.

`./course lab` serves a fresh copy of the checkout (root dir widened to hold labs/ and
solutions/); Playwright drives the system's Chromium. For each notebook: open it, look
at the stored outputs (no stale progress-bar or widget text), Run All from the menu, then
check that every cell ran, no cell shows an error, the progress bars render as widgets
(not as their text fallback) and every plot appears. Screenshots go to $BROWSER_ARTIFACTS
(default tests/artifacts/browser/). While this test is on, it is these notebooks' only run:
their nbval items are deselected (conftest.py), so a failing cell fails here.
"""

import json
import os
import re
from pathlib import Path

import pytest
from chromium import require_chromium
from course_lab import ROOT, LabServer, fresh_checkout

pytestmark = pytest.mark.browser

ARTIFACTS = Path(os.environ.get("BROWSER_ARTIFACTS", ROOT / "tests" / "artifacts" / "browser"))
RUN_TIMEOUT_MS = 900_000  # notebook 04 trains for a while; the machine may be loaded

# notebook -> (plots, progress-bar widgets) a learner sees after Run All. The labs, as a
# learner opens them; solutions/04 renders the same widgets and plot (nbval runs it, and
# tests/browser/test_site.py checks its stored outputs on the website)
EXPECTED = {
    "labs/00_setup_and_diagnostics.ipynb": (0, 0),
    "labs/04_the_training_loop.ipynb": (1, 1),
}
WIDGET_AS_TEXT = re.compile(r"HBox\(children=|FloatProgress\(|model not found|Error displaying widget")
# a stored bar is stale unless it shows the run's finished state ("100%|"): "0%|" is the
# text a widget stores when it is created, not what the run did
STALE = re.compile(rf"\b(?!100%)\d{{1,3}}%\||{WIDGET_AS_TEXT.pattern}")
ERROR = re.compile(r"Traceback|^\w*(Error|Exception)\b", re.M)

# user settings in the throwaway HOME: every cell attached to the DOM, no news toasts
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}

WATCH_PROMPTS = """() => {
    window.__ranSomething = false;
    new MutationObserver(() => {
        if ([...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*')))
            window.__ranSomething = true;
    }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""
RUN_FINISHED = """() => window.__ranSomething
    && ![...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'))"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    require_chromium()
    tmp = tmp_path_factory.mktemp("browser")
    checkout = fresh_checkout(tmp / "grpo-lab")
    home = tmp / "home"
    for name, values in SETTINGS.items():
        plugin, _, file = name.rpartition("/")
        path = home / ".jupyter/lab/user-settings" / plugin / f"{file}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    with LabServer(checkout, home, args=(f"--ServerApp.root_dir={checkout}",)) as server:
        yield server
        server.stop()
        assert server.leftovers() == []


def run_all_and_look(page, lab: LabServer, notebook: str, shots: str) -> dict:
    """Open `notebook`, Run All from the menu; what was seen, with screenshots `shots`-*.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.goto(f"http://127.0.0.1:{lab.port}/lab/tree/{notebook}?reset&token={lab.token}")
    panel = page.locator(".jp-NotebookPanel:visible")
    panel.locator(".jp-CodeCell").first.wait_for(timeout=120_000)
    panel.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').wait_for(timeout=180_000)
    page.wait_for_timeout(2_000)  # stored widget outputs render asynchronously
    seen = {"opened": panel.locator(".jp-OutputArea-output").all_inner_texts()}
    page.screenshot(path=f"{shots}-1-opened.png")

    page.evaluate(WATCH_PROMPTS)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
    page.wait_for_function(RUN_FINISHED, timeout=RUN_TIMEOUT_MS, polling=500)
    page.wait_for_timeout(2_000)  # last outputs and widget views settle

    outputs = panel.locator(".jp-OutputArea-output")
    images = panel.locator(".jp-OutputArea .jp-RenderedImage img")
    bars = panel.locator(".jp-OutputArea .widget-hprogress")
    seen.update(
        prompts=panel.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts(),
        outputs=outputs.all_inner_texts(),
        stderr=panel.locator('[data-mime-type="application/vnd.jupyter.stderr"]').all_inner_texts(),
        plots=images.evaluate_all("imgs => imgs.filter(i => i.complete && i.naturalWidth > 0).length"),
        bars=bars.count(),
    )
    page.screenshot(path=f"{shots}-2-after-run-all.png")
    for i in range(images.count()):
        images.nth(i).scroll_into_view_if_needed()
        images.nth(i).screenshot(path=f"{shots}-3-plot-{i}.png")
    for i in range(bars.count()):
        bars.nth(i).scroll_into_view_if_needed()
        bars.nth(i).locator("xpath=ancestor::div[contains(@class,'jp-OutputArea-output')]").screenshot(
            path=f"{shots}-4-progress-{i}.png"
        )
    return seen


def problems(seen: dict, plots: int, bars: int) -> list[str]:
    """What a learner would notice as broken in `seen`; empty when all is well."""
    found = [f"stale output on opening: {t[:120]!r}" for t in seen["opened"] if STALE.search(t)]
    found += [f"cell {i} did not run: {p!r}" for i, p in enumerate(seen["prompts"])
              if not re.search(r"\[\d+\]", p)]
    found += [f"error output: {t[:300]!r}" for t in seen["stderr"] if ERROR.search(t)]
    found += [f"widget shown as text: {t[:120]!r}" for t in seen["outputs"] if WIDGET_AS_TEXT.search(t)]
    if seen["plots"] != plots:
        found.append(f"{seen['plots']} plots shown, expected {plots}")
    if seen["bars"] < bars:
        found.append(f"{seen['bars']} progress-bar widgets shown, expected {bars}")
    return found


@pytest.mark.parametrize("notebook", EXPECTED)
def test_run_all_in_jupyterlab(lab, browser, notebook):
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    try:
        shots = str(ARTIFACTS / notebook.replace("/", "-").removesuffix(".ipynb"))
        seen = run_all_and_look(page, lab, notebook, shots)
    finally:
        page.close()
    print(f"{notebook}: {seen['plots']} plots, {seen['bars']} progress bars; screenshots {shots}-*.png")
    assert problems(seen, *EXPECTED[notebook]) == []
