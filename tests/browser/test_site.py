"""The course website (issue 16): `./course site` builds it; every page works in a browser.

The test builds the site as a reader's publisher would (`./course site --out DIR`), serves
DIR/html on a free localhost port and opens every HTML page in headless Chromium. On each
page: HTTP 200, a title, non-empty main content, every <img> loaded (naturalWidth > 0), every
same-host resource it asked for (CSS, JS, images) answered, no stored error output or Python
traceback, no widget placeholder ("Loading widget") and no stale progress bar (a bar left at
0%); a notebook page shows at least as many images as its .ipynb stores image/png outputs,
and the final text of each stored progress-bar widget. Then every distinct same-host link
of all pages must answer 200, and a link's #fragment must name an element of its page.
Requests to other hosts (MathJax's CDN) are not made: the machine may be offline.

A page with a problem is saved as a screenshot in $SITE_ARTIFACTS (default
tests/artifacts/site/): full-page screenshots of every page cost a quarter of the test's
CPU (14 of 54 s).
A second test breaks a copy of the built site (a dead link, a missing figure, a progress
bar at 0%) and checks that the same checks report each problem.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urldefrag, urlsplit

import pytest
from course_lab import ROOT

pytestmark = pytest.mark.browser

ARTIFACTS = Path(os.environ.get("SITE_ARTIFACTS", ROOT / "tests" / "artifacts" / "site"))
BUILD_TIMEOUT_S = 900
STALE_BAR = re.compile(r"(?<![\d.])0%\|")  # a tqdm bar at 0% ("100%|" is a finished one)
WIDGET_PLACEHOLDER = re.compile(r"Loading widget|HBox\(children=|FloatProgress\(|Error displaying widget")
TRACEBACK = "Traceback (most recent call last)"
ERROR_OUTPUT = ".cell_output .output.traceback, .cell_output .output.error"


def space(text: str) -> str:
    return " ".join(text.split())


def stored(notebook: Path) -> tuple[int, list[str]]:
    """The image/png outputs a notebook stores, and the final texts of its widget outputs."""
    images, widget_texts = 0, []
    for cell in json.loads(notebook.read_text())["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            images += "image/png" in data
            if "application/vnd.jupyter.widget-view+json" in data:
                widget_texts.append(space("".join(data["text/plain"])))
    return images, widget_texts


@dataclass
class Site:
    html: Path  # the site
    url: str  # where it is served
    src: Path  # the pages as built (the notebooks staged from solutions/ by book/build.py)
    build_seconds: float = 0.0
    pages: list[str] = field(init=False)

    def __post_init__(self):
        self.pages = sorted(
            str(p.relative_to(self.html)) for p in self.html.rglob("*.html")
            if not p.relative_to(self.html).parts[0].startswith("_")  # theme templates in _static/
        )


@functools.cache
def build_site(out: Path) -> tuple[Path, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [str(ROOT / "course"), "site", "--out", str(out)], cwd=ROOT, capture_output=True,
        text=True, timeout=BUILD_TIMEOUT_S,
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 0, f"./course site failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    print(done.stdout.strip())
    return out / "html", seconds


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the browser closing a connection early (a page closed while loading)


def serve(directory: Path):
    """A static server for `directory` on a free localhost port, in a thread (shut it down)."""
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def look_at(page, site: Site, page_path: str, shots: Path | None) -> tuple[list[str], dict]:
    """Open one page of the site in `page` (the one tab the whole check reads the site in, as
    a reader's browser does: a tab per page cost twice the CPU, most of it starting renderer
    processes); (problems, {"links": same-host hrefs, "ids": element ids, ...})."""
    host = urlsplit(site.url).netloc
    bad_resources: list[str] = []

    def on_response(r):
        if urlsplit(r.url).netloc == host and r.status >= 400:
            bad_resources.append(f"{r.status} {r.url}")

    def on_failed(r):
        if urlsplit(r.url).netloc == host:
            bad_resources.append(f"failed {r.url}")

    page.on("response", on_response)
    page.on("requestfailed", on_failed)
    problems: list[str] = []
    try:
        response = page.goto(site.url + page_path, wait_until="load")
        if response is None or response.status != 200:
            return [f"HTTP {response.status if response else 'no response'}"], {"links": [], "ids": []}
        page.wait_for_load_state("networkidle")
        main = page.locator("main").first
        text = main.inner_text() if main.count() else ""
        seen = page.evaluate("""() => ({
            title: document.title.trim(),
            images: [...document.querySelectorAll('img')].map(i => ({
                src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0,
                output: !!i.closest('.cell_output')})),
            links: [...document.querySelectorAll('a[href]')].map(a => a.href),
            ids: [...document.querySelectorAll('[id]')].map(e => e.id),
        })""")
        if not seen["title"]:
            problems.append("no title")
        if not space(text):
            problems.append("empty main content")
        problems += [f"image not loaded: {i['src']}" for i in seen["images"] if not i["ok"]]
        problems += [f"resource: {r}" for r in bad_resources]
        if page.locator(ERROR_OUTPUT).count() or TRACEBACK in text:
            problems.append("a stored error output or traceback is shown")
        if m := WIDGET_PLACEHOLDER.search(text):
            problems.append(f"widget placeholder text: {m.group(0)!r}")
        if m := STALE_BAR.search(text):
            problems.append(f"stale progress bar: {text[max(0, m.start() - 60):m.end() + 20]!r}")
        source = site.src / Path(page_path).with_suffix(".ipynb")  # as built, not as now
        if page_path.startswith("solutions/") and source.is_file():
            images, bars = stored(source)
            shown = sum(i["ok"] and i["output"] for i in seen["images"])
            if shown < images:
                problems.append(f"{shown} figures shown, the notebook stores {images}")
            flat = space(text)
            problems += [f"progress bar's final text missing: {bar[:80]!r}" for bar in bars
                         if bar not in flat]
        if problems and shots is not None:  # what is wrong, for whoever reads the CI log
            page.screenshot(path=str(shots / f"{page_path.replace('/', '-')}.png"),
                            full_page=True)
        seen["images_shown"] = sum(i["ok"] for i in seen["images"])
        return problems, seen
    finally:
        page.remove_listener("response", on_response)
        page.remove_listener("requestfailed", on_failed)


def check_site(browser, site: Site, pages: list[str], shots: Path | None = None) -> dict:
    """Open `pages` and check their links; {"problems": [...], "pages": n, "links": n, ...}."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    try:
        page = context.new_page()
        page.route(re.compile(r"^(?!http://127\.0\.0\.1:)"), lambda route: route.abort())  # offline
        return _check_pages(page, site, pages, shots)
    finally:
        context.close()


def _check_pages(page, site: Site, pages: list[str], shots: Path | None) -> dict:
    problems, links, ids, images = [], set(), {}, 0
    for page_path in pages:
        found, seen = look_at(page, site, page_path, shots)
        problems += [f"{page_path}: {p}" for p in found]
        ids[page_path] = set(seen["ids"])
        images += seen.get("images_shown", 0)
        links |= {(page_path, href) for href in seen["links"] if href.startswith(site.url)}
    statuses: dict[str, int] = {}
    for page_path, href in sorted(links):
        target, fragment = urldefrag(href)
        if target not in statuses:
            statuses[target] = status_of(target)
        if statuses[target] != 200:
            problems.append(f"{page_path}: dead link {href} (HTTP {statuses[target]})")
            continue
        rel = target.removeprefix(site.url) or "index.html"
        if fragment and rel.endswith(".html"):
            if rel not in ids:
                _, seen = look_at(page, site, rel, None)
                ids[rel] = set(seen["ids"])
            if fragment not in ids[rel]:
                problems.append(f"{page_path}: link to a missing anchor {href}")
    return {"problems": problems, "pages": len(pages), "links": len(statuses), "images": images}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    html, seconds = build_site(tmp_path_factory.mktemp("site") / "site")
    server, url = serve(html)
    try:
        yield Site(html, url, html.parent / "src", seconds)
    finally:
        server.shutdown()
        server.server_close()


def test_site_builds_and_every_page_works(site, browser):
    assert "index.html" in site.pages
    for notebook in sorted((site.src / "solutions").glob("*.ipynb")):
        assert f"solutions/{notebook.stem}.html" in site.pages, f"no page for {notebook.name}"
    for doc in ["docs/reports/README", "docs/reports/000", "docs/glossary", "docs/pacing"]:
        assert f"{doc}.html" in site.pages
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    result = check_site(browser, site, site.pages, shots=ARTIFACTS)
    print(f"site build: {site.build_seconds:.1f} s (./course site); pages checked: "
          f"{result['pages']}; images loaded: {result['images']}; distinct internal links "
          f"checked: {result['links']}; screenshots of pages with a problem: {ARTIFACTS}")
    assert result["problems"] == []


def test_the_checks_catch_a_broken_page(site, browser, tmp_path):
    """A copy of the site with a dead link, a missing figure and a stale bar: each reported."""
    broken = tmp_path / "html"
    shutil.copytree(site.html, broken)
    page = "solutions/04_the_training_loop.html"
    html = (broken / page).read_text()
    figure = re.search(r'<img[^>]+src="\.\./(_images/[^"]+\.png)"', html).group(1)
    (broken / figure).unlink()
    html = re.sub(r"(<main[^>]*>)", r'\1<a href="no-such-page.html">x</a>'
                  r'<a href="05_break_it.html#no-such-anchor">y</a><pre>GRPO:   0%| | 0/150</pre>',
                  html, count=1)
    (broken / page).write_text(html)
    server, url = serve(broken)
    try:
        problems = check_site(browser, Site(broken, url, site.src), [page])["problems"]
    finally:
        server.shutdown()
        server.server_close()
    expected = [f"image not loaded: ../{figure}", f"resource: 404 {url}{figure}",
                "figures shown, the notebook stores", "dead link", "missing anchor",
                "stale progress bar"]
    print("reported on the broken copy:", *problems, sep="\n  ")
    for what in expected:
        assert any(what in p for p in problems), f"not reported: {what!r} in {problems}"
