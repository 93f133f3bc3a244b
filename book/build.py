"""Build the course website: `./course site` runs this (Jupyter Book 1.x, the `site` extra).

    .venv/bin/python book/build.py [--out DIR]     (default DIR: build/site)

The site is the completed notebooks of solutions/ with their stored outputs (nothing is
executed), the field-report pages, the glossary, the pacing guide and the recorded figures,
with the navigation of book/_toc.yml (the course map of README.md). Nothing is written into
the repository's sources: the pages are staged in DIR/src, keeping the repository's layout so
that the relative links between them still work, and built there; the site is DIR/html.

Staging changes only what a static page needs:
- index.md, the home page, is README's "What this is" and its course map ("Notebooks"), with
  each notebook linked to its page and to its lab notebook (a download).
- A link to a repository file that is not a page (the lab notebooks in labs/, ...) becomes a
  download of that file from the site; a link that resolves to no file stops the build.
- Notebook 13's diagnosis cell is shown as the lab has it (its `diagnose(...)` calls blank,
  no output): the solution's answers are the key of the course's mystery runs.
- Nothing else: a notebook's widget outputs (progress bars) show their stored final text,
  as _config.yml's nb_mime_priority_overrides says (a static page has no widget state).
- With GRPO_LAB_REPO_URL set (https://github.com/OWNER/REPO; GRPO_LAB_REPO_BRANCH, default
  main), pages get a repository button, and each notebook page a launch line below its title:
  its lab opened in Colab, with the one line that installs the course's package there.

Sphinx's warnings are errors (a page missing from the toc, a reference that does not
resolve), so a broken site fails the build. It prints the build time and the page count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
MD_LINK = re.compile(r"(!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\s*\))")
TOC_FILE = re.compile(r"^\s*-?\s*(?:root|file):\s*(\S+)\s*$", re.M)
COURSE_MAP_ROW = re.compile(r"^\| (\d\d) \| `(\d\d_\w+)` \|", re.M)
GITHUB_REPO = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+$")
COLAB = "https://colab.research.google.com/github"


def toc_pages() -> list[str]:
    """The toc's pages as repository paths without suffix, in order (the root first)."""
    return TOC_FILE.findall((BOOK / "_toc.yml").read_text())


def source_of(page: str) -> Path:
    """The repository file (or, for the home page, the generated file) behind a toc page."""
    if page == "index":
        return ROOT / "README.md"
    for suffix in (".ipynb", ".md"):
        if (ROOT / f"{page}{suffix}").is_file():
            return ROOT / f"{page}{suffix}"
    raise SystemExit(f"site: book/_toc.yml names {page!r}, which is no .ipynb or .md file")


def readme_section(readme: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if not match:
        raise SystemExit(f"site: README.md has no '## {title}' section for the home page")
    return match.group(1).strip()


def check_course_map(pages: list[str]) -> list[str]:
    """The toc's notebooks must be solutions/*.ipynb and README's course map, in its order."""
    in_toc = [p.removeprefix("solutions/") for p in pages if p.startswith("solutions/")]
    on_disk = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
    in_readme = [m.group(2) for m in COURSE_MAP_ROW.finditer((ROOT / "README.md").read_text())]
    if not in_toc == on_disk == in_readme:
        raise SystemExit(
            "site: book/_toc.yml, solutions/*.ipynb and README's course map disagree:\n"
            f"  toc:     {in_toc}\n  on disk: {on_disk}\n  README:  {in_readme}"
        )
    return in_toc


def home_page() -> str:
    """index.md: README's "What this is" and course map, each notebook linked."""
    readme = (ROOT / "README.md").read_text()

    def link_row(match: re.Match) -> str:
        number, name = match.groups()
        lab = f" ([lab](labs/{name}.ipynb))" if (ROOT / "labs" / f"{name}.ipynb").is_file() else ""
        return f"| {number} | [{name}](solutions/{name}.ipynb){lab} |"

    course_map = COURSE_MAP_ROW.sub(link_row, readme_section(readme, "Notebooks"))
    return f"""# GRPO Lab

{readme_section(readme, "What this is")}

## Course map

{course_map}

The pages show the completed notebooks of `solutions/` with the outputs of one clean run; the
"lab" links download the student notebooks of `labs/`, with the exercises. To run them, clone
the repository and start JupyterLab with `./course lab` (README.md, the top).

## Also here

- [The five field reports](docs/reports/README.md): the training runs that broke, which the
  course reproduces and fixes.
- [Glossary](docs/glossary.md), [pacing guide](docs/pacing.md) and the
  [open experiments](docs/open-experiments.md) with their rubrics.
- [Recorded figures](benchmarks/RESULTS.md): speed and behaviour, with the commands.
"""


class Stager:
    """Copies pages into `src`, rewriting links to repository files that are not pages."""

    def __init__(self, src: Path, pages: set[Path]):
        self.src, self.pages, self.downloads = src, pages, set()

    def rewrite(self, text: str, folder: Path, where: str) -> str:
        def one(match: re.Match) -> str:
            head, target, tail = match.groups()
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//|^#", target):
                return match.group(0)  # a URL, a download already, an anchor on the page
            path, _, anchor = target.partition("#")
            resolved = (folder / path).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                raise SystemExit(f"site: dead link in {where}: {target}")
            if resolved in self.pages:
                return match.group(0)
            if resolved.is_dir():
                raise SystemExit(f"site: {where} links the folder {target}, which is no page")
            self.downloads.add(resolved)
            return f"{head}path:{target}{tail}"

        return MD_LINK.sub(one, text)

    def stage(self, source: Path, rel: str, text: str | None = None) -> None:
        dest = self.src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        where = str(source.relative_to(ROOT))
        if source.suffix == ".ipynb":
            notebook = json.loads(source.read_text())
            notebook["metadata"].pop("widgets", None)
            launch = launch_line(ROOT / "labs" / source.name) if source.parent == ROOT / "solutions" \
                else None
            if launch is not None:  # right below the page's title, the first line of its first cell
                title, _, rest = "".join(notebook["cells"][0]["source"]).partition("\n")
                notebook["cells"][0]["source"] = f"{title}\n\n{launch}\n{rest}"
            for cell in notebook["cells"]:
                if cell["cell_type"] == "code" and "### BEGIN DIAGNOSIS" in "".join(cell["source"]):
                    from grpo_lab.course.labs import student_source

                    cell["source"] = student_source("".join(cell["source"]), where)
                    cell["outputs"], cell["execution_count"] = [], None
                if cell["cell_type"] == "markdown":
                    text_in = "".join(cell["source"])
                    cell["source"] = self.rewrite(text_in, source.parent, where)
                for output in cell.get("outputs", []):
                    data = output.get("data", {})
                    if "application/vnd.jupyter.widget-view+json" in data and "text/plain" not in data:
                        raise SystemExit(f"site: {where} has a widget output without a text")
            dest.write_text(json.dumps(notebook, indent=1, ensure_ascii=False))
        else:
            dest.write_text(self.rewrite(text or source.read_text(), source.parent, where))

    def stage_downloads(self) -> None:
        for path in self.downloads:
            dest = self.src / path.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)


def repository() -> tuple[str, str] | None:
    """(url, branch) of the course's public repository, from GRPO_LAB_REPO_URL and
    GRPO_LAB_REPO_BRANCH (default main): the one place the site learns it; None when unset."""
    url = os.environ.get("GRPO_LAB_REPO_URL", "").strip().removesuffix("/").removesuffix(".git")
    if not url:
        return None
    return url, os.environ.get("GRPO_LAB_REPO_BRANCH", "").strip() or "main"


def config_text() -> str:
    config = (BOOK / "_config.yml").read_text()
    repo = repository()
    if repo:
        url, branch = repo
        config = config.replace("use_repository_button: false", "use_repository_button: true")
        config += f"\nrepository:\n  url: {json.dumps(url)}\n  branch: {json.dumps(branch)}\n"
    return config


def launch_line(lab: Path) -> str | None:
    """The paragraph a notebook page gets below its title when the repository is public on
    GitHub: the page's lab (labs/NN_name.ipynb) opened in Colab, and how to install the
    course's package there. None without a GitHub repository or a lab."""
    repo = repository()
    if repo is None or not GITHUB_REPO.match(repo[0]) or not lab.is_file():
        return None
    url, branch = repo
    rel = lab.relative_to(ROOT).as_posix()
    text = (f"**Run it on a hosted notebook service:** [open `{rel}` in Colab]"
            f"({COLAB}/{url.removeprefix('https://github.com/')}/blob/{branch}/{rel}). "
            "Colab has torch but not the course's package: run "
            f"`%pip install git+{url}@{branch}` in a cell above the first one, then restart "
            "the session. Opened alone, a lab finds none of your earlier labs, so the ones "
            "that reuse your functions (`load_yours`) say so and run the references instead.")
    return text


def build(out: Path) -> Path:
    """Stage and build the site under `out`; returns the site's folder (out/html)."""
    start = time.perf_counter()
    out = out.resolve()
    if out == ROOT or ROOT.is_relative_to(out) or out.is_relative_to(ROOT / "solutions") \
            or out.is_relative_to(ROOT / "docs"):
        raise SystemExit(f"site: refusing to build into {out}")
    pages = toc_pages()
    notebooks = check_course_map(pages)
    src, html = out / "src", out / "html"
    for old in (src, html, out / "_build"):
        shutil.rmtree(old, ignore_errors=True)
    src.mkdir(parents=True)
    page_files = {source_of(p).resolve() for p in pages if p != "index"}
    stager = Stager(src, page_files)
    (src / "_toc.yml").write_text((BOOK / "_toc.yml").read_text())
    (src / "_config.yml").write_text(config_text())
    stager.stage(ROOT / "README.md", "index.md", text=home_page())
    for page in pages[1:]:
        source = source_of(page)
        stager.stage(source, str(source.relative_to(ROOT)))
    stager.stage_downloads()

    jupyter_book = shutil.which("jupyter-book", path=str(Path(sys.executable).parent)) \
        or shutil.which("jupyter-book")
    if not jupyter_book:
        raise SystemExit("site: no jupyter-book command: ./course site installs it "
                         "(pyproject.toml's site extra), or pip install 'jupyter-book>=1.0.4,<2'")
    command = [jupyter_book, "build", str(src), "--path-output", str(out),
               "--builder", "html", "--warningiserror", "--keep-going"]
    print(f"[site] building {len(pages)} pages ({len(notebooks)} notebooks, stored outputs) "
          f"with Jupyter Book into {html}", flush=True)
    done = subprocess.run(command, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode != 0:
        sys.stdout.write(done.stdout)
        raise SystemExit(f"site: jupyter-book build failed (exit {done.returncode}; output above)")
    (out / "_build" / "html").rename(html)
    shutil.rmtree(out / "_build", ignore_errors=True)
    (html / ".nojekyll").touch()  # GitHub Pages: serve _static/ and _images/ as they are
    built = len(list(html.rglob("*.html")))
    print(f"[site] built in {time.perf_counter() - start:.1f} s: {built} HTML files "
          f"({len(pages)} pages in the navigation, {len(stager.downloads)} downloads) in {html}")
    print(f"[site] preview: .venv/bin/python -m http.server -d {html} 8000, then open http://localhost:8000")
    return html


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "site",
                        help="output folder (default: build/site); the site is OUT/html")
    build(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
