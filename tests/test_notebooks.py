"""Stored notebook outputs read right where people read them without running them."""

import glob

import nbformat

from grpo_lab.course.notebooks import WIDGET_VIEW, final_progress_text


def test_a_progress_bar_is_stored_with_its_final_text():
    state = {
        "box": {"state": {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]}},
        "l": {"state": {"value": "GRPO: 100%"}},
        "p": {"state": {"value": 150, "max": 150}},
        "r": {"state": {"value": " 150/150 [00:20&lt;00:00,  7.9step/s]"}},
    }
    output = {"data": {WIDGET_VIEW: {"model_id": "box"}, "text/plain": "GRPO:   0%| | 0/150"}}
    final_progress_text(output, state)
    assert output["data"]["text/plain"] == "GRPO: 100%|██████████| 150/150 [00:20<00:00,  7.9step/s]"
    other = {"data": {WIDGET_VIEW: {"model_id": "x"}, "text/plain": "Button()"}}
    final_progress_text(other, {"x": {"state": {"children": []}}})
    assert other["data"]["text/plain"] == "Button()"  # not a progress bar: left alone


def test_no_stored_progress_bar_shows_its_starting_text():
    stale = []
    for path in sorted(glob.glob("solutions/*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            for output in cell.get("outputs", []):
                text = output.get("data", {}).get("text/plain", "")
                if WIDGET_VIEW in output.get("data", {}) and " 0%|" in text:
                    stale.append(f"{path} cell {i}: {text}")
    assert not stale, "\n".join(stale)


def test_no_control_characters_in_the_text():
    """A LaTeX command written in a non-raw Python string loses its backslash: `\\b` in
    `\\big` becomes a backspace, `\\a` in `\\approx` a bell, `\\t` in `\\text` a tab, and the
    formula renders broken. No cell source or doc holds a control character (tabs
    included; newlines are the only one allowed)."""
    bad = []
    texts = [(p, i, "".join(c["source"])) for p in sorted(glob.glob("solutions/*.ipynb"))
             + sorted(glob.glob("labs/*.ipynb"))
             for i, c in enumerate(nbformat.read(p, as_version=4).cells)]
    texts += [(p, "-", open(p, encoding="utf-8", newline="").read())
              for p in sorted(glob.glob("docs/**/*.md", recursive=True)) + ["README.md"]]
    for path, cell, text in texts:
        for n, line in enumerate(text.split("\n"), 1):  # not splitlines: it splits at \r
            found = sorted({repr(ch) for ch in line if ord(ch) < 32 or ord(ch) == 127})
            if found:
                bad.append(f"{path} cell {cell} line {n}: {', '.join(found)} in {line[:60]!r}")
    assert not bad, "\n".join(bad)
