"""Notebook 13, diagnose the run: the shipped runs show the causes of their key, nothing a
learner gets holds the key, the grader scores diagnoses against it (solutions full marks,
an untouched lab 0, random answers 0.1 by enumeration), and each hidden failure shows its
symptom in a short run."""

import itertools
import json
import re
from pathlib import Path

import pytest
from mystery_rules import rule_diagnosis

from grpo_lab.cli import main as cli
from grpo_lab.course import diagnose as d
from grpo_lab.course import grade, labs

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "13_diagnose_the_run.ipynb"
LAB = ROOT / "labs" / "13_diagnose_the_run.ipynb"


@pytest.fixture(scope="module")
def runs():
    return d.load_runs()


@pytest.fixture(scope="module")
def key():
    return labs.diagnosis_key(SOLUTION)


def test_the_shipped_runs_show_the_causes_the_solution_names(runs, key):
    """The fixed rules of tests/mystery_rules.py, run on each shipped run against the
    baseline, reach the cause solutions/13 gives it; and every answer's fix is its cause's."""
    assert sorted(key) == sorted(d.RUN_NAMES) == sorted(n for n in runs if n != d.BASELINE)
    got = {name: rule_diagnosis(runs[name], runs[d.BASELINE]) for name in key}
    assert got == {name: v["cause"] for name, v in key.items()}
    assert all(v["fix"] == d.FIX_OF[v["cause"]] for v in key.values())
    assert rule_diagnosis(runs[d.BASELINE], runs[d.BASELINE]) == "healthy"


def test_nothing_a_learner_gets_holds_the_key(runs, key):
    """The lab's diagnoses are blank; the run files hold the logged columns, one claimed
    config, and log lines of the run's own (no cause, fix or time); the manifest holds no
    answer."""
    lab = json.loads(LAB.read_text())
    calls = [v for c in lab["cells"] if c["cell_type"] == "code"
             for _, v in labs.predict_calls("".join(c["source"]), "diagnose")]
    assert len(calls) == len(key) and all(set(v.values()) == {None} for v in calls)
    assert all(not c.get("outputs") for c in lab["cells"] if c["cell_type"] == "code")

    words = set(d.CAUSES) | (set(d.FIXES) - {"none"})  # "none" is an English word
    line = re.compile(r"training 60 steps: .+|step 0: eval accuracy [\d.]+|step \d+: reward "
                      r"[\d.]+, loss -?[\d.]+, kl [\d.]+(, eval accuracy [\d.]+)?|done: 60 "
                      r"steps|(step \d+|the evaluation at step 0) failed: \w+: .+")
    configs = set()
    for name, run in runs.items():
        folder = d.SHIPPED_RUNS / name
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["metrics.jsonl", d.LOG, d.CONFIG])
        for p in folder.iterdir():
            text = p.read_text()
            assert not any(w in text for w in words), (name, p.name)
        assert all(set(m) <= set(d.COLUMNS) for m in run.metrics), name
        assert all(line.fullmatch(x) for x in run.log.splitlines()), run.log
        configs.add(json.dumps(run.config, sort_keys=True))
    assert len(configs) == 1

    spec = labs.load_manifest()["notebooks"]["13_diagnose_the_run.ipynb"]
    assert [x["run"] for x in spec["diagnoses"]] == list(d.RUN_NAMES)
    assert all(set(x) == {"run", "cell_id", "cell_index", "points"} for x in spec["diagnoses"])


def test_random_answers_score_what_expected_random_score_says(key):
    """Every (cause, fix) answer, each with a sentence that cites the run, enumerated: the
    mean score is expected_random_score's 0.1; the best constant answer is 'healthy'."""
    evidence = "the kl at step 1 is 0.2 where the baseline has exactly 0"
    total = 0
    for truth in key.values():
        for cause, fix in itertools.product(d.CAUSES, d.FIXES):
            total += d.score_run({"cause": cause, "fix": fix, "evidence": evidence}, truth)[0]
    mean = total / (len(d.CAUSES) * len(d.FIXES) * len(key) * d.POINTS)
    assert mean == pytest.approx(d.expected_random_score()) == pytest.approx(0.1)
    constant = {c: sum(d.score_run({"cause": c, "fix": d.FIX_OF[c], "evidence": evidence}, t)[0]
                       for t in key.values()) for c in d.CAUSES}
    assert max(constant, key=constant.get) == "healthy" and constant["healthy"] == 6


@pytest.mark.parametrize("answer,points", [
    ({"cause": "healthy", "fix": "none", "evidence": "grad_norm and kl look like the baseline "
                                                     "on every step of it"}, 3),
    ({"cause": "healthy", "fix": "none", "evidence": "it looks fine to me honestly, really fine "
                                                     "overall"}, 2),  # cites nothing
    ({"cause": "healthy", "fix": "none", "evidence": "kl fine"}, 2),  # too short
    ({"cause": "lr-100x", "fix": "none", "evidence": "kl at step 2 is large compared with the "
                                                     "baseline"}, 1),  # evidence needs the cause
])
def test_a_diagnosis_scores_cause_fix_and_evidence(answer, points):
    assert d.score_run(answer, {"cause": "healthy", "fix": "none"})[0] == points


def _submission(tmp_path, who, diagnosis_cell):
    nb = json.loads(LAB.read_text())
    for c in nb["cells"]:
        if "diagnose('A'" in "".join(c["source"]):
            c["source"] = diagnosis_cell
    path = tmp_path / who / "13_diagnose_the_run.ipynb"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(nb))
    return path


def test_the_grader_scores_the_capstone_against_its_key(tmp_path, key):
    """The solution scores 30 of 30, the untouched lab 0 (not implemented), a hostile
    argument 0 without running; another key (--mystery-key) grades the same answers again."""
    solution = json.loads(SOLUTION.read_text())
    cell = next("".join(c["source"]) for c in solution["cells"]
                if "### BEGIN DIAGNOSIS" in "".join(c["source"]))
    canary = tmp_path / "canary"
    hostile = ("diagnoses = {}\n" + "\n".join(
        f'diagnoses["{n}"] = diagnose("{n}", cause=open({str(canary)!r}, "w").write("x"), '
        'fix="none", evidence="x")' for n in d.RUN_NAMES))
    untouched = tmp_path / "untouched" / LAB.name
    untouched.parent.mkdir()
    untouched.write_bytes(LAB.read_bytes())
    paths = [_submission(tmp_path, "solved", cell), untouched,
             _submission(tmp_path, "hostile", hostile)]
    out = tmp_path / "grades.json"
    assert grade.main([str(p) for p in paths], str(out), None,
                      journal=str(tmp_path / "j.jsonl")) == 0
    rows = json.loads(out.read_text())
    by = {who: [r for r in rows if r["student"] == who] for who in ("solved", "untouched",
                                                                     "hostile")}
    assert sum(r["points"] for r in by["solved"]) == 30 == sum(r["max_points"] for r in by["solved"])
    assert sum(r["points"] for r in by["untouched"]) == 0
    assert {r["status"] for r in by["untouched"]} == {"not implemented"}
    # the hostile cause is no cause: only fix="none" scores, on the healthy runs
    healthy = sum(v["cause"] == "healthy" for v in key.values())
    assert sum(r["points"] for r in by["hostile"]) == healthy and not canary.exists()
    assert all("cause must be one of" in r["reason"] for r in by["hostile"])

    other = {n: {"cause": "healthy", "fix": "none"} for n in d.RUN_NAMES}
    key_file = tmp_path / "key.json"
    key_file.write_text(json.dumps({"runs": other}))
    out2 = tmp_path / "grades2.json"
    assert grade.main([str(paths[0])], str(out2), None, journal=str(tmp_path / "j.jsonl"),
                      mystery_key=str(key_file)) == 0
    assert sum(r["points"] for r in json.loads(out2.read_text())) == healthy * 3
    key_file.write_text("[1, 2]")
    assert grade.main([str(paths[0])], None, None, journal=str(tmp_path / "j2.jsonl"),
                      mystery_key=str(key_file)) == 2


def test_the_draw_is_two_healthy_runs_and_eight_distinct_failures():
    for secret in range(20):
        k = d.draw_key(secret)
        causes = [v["cause"] for v in k.values()]
        assert list(k) == list(d.RUN_NAMES) and causes.count("healthy") == 2
        assert len(set(causes)) == 9 and all(v["fix"] == d.FIX_OF[v["cause"]] for v in k.values())
    assert d.draw_key(7) == d.draw_key(7) != d.draw_key(8)


# each failure's first symptom, in a run of a few steps (seed 5)
SYMPTOMS = {
    "healthy": (2, lambda ms, log: ms[1]["kl"] == 0 and ms[2]["log_ratio/max_abs"] == 0),
    "pad-token-oov": (1, lambda ms, log: "IndexError: index out of range" in log),
    "greedy-sampling": (2, lambda ms, log: all(m["frac_reward_zero_std"] == 1 for m in ms[1:])),
    "constant-clip": (1, lambda ms, log: ms[1]["loss"] > 0.1 and ms[1]["clip_ratio/region_mean"] > 0.1),
    "ratio-vs-reference": (3, lambda ms, log: ms[1]["log_ratio/max_abs"] == 0
                           and ms[3]["log_ratio/max_abs"] > 0.05),
    "step-inside": (1, lambda ms, log: ms[1]["kl"] > 0),
    "lr-100x": (3, lambda ms, log: max(m.get("kl", 0) for m in ms) > 0.5),
    # a NaN reward is written as null (metrics.jsonl is strict JSON)
    "nan-rewards": (12, lambda ms, log: any("reward" in m and m["reward"] is None for m in ms)
                    and "failed" in log),
}


@pytest.mark.parametrize("cause", SYMPTOMS)
def test_each_hidden_failure_shows_its_symptom(tmp_path, cause):
    steps, symptom = SYMPTOMS[cause]
    out = d.make_run(cause, 5, tmp_path / cause, steps=steps)
    ms = _metrics(out)
    assert symptom(ms, (out / d.LOG).read_text()), (ms, (out / d.LOG).read_text())


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_quiet_failures_against_a_healthy_run_of_the_same_seed(tmp_path):
    """Same seed, so the same first batch: one micro-batch of four keeps about half the
    gradient's norm (independent halves: 1/sqrt(4)); after one update the clamped difference
    is first order in the drift where k3 is second order."""
    healthy = _metrics(d.make_run("healthy", 5, tmp_path / "h", steps=2))
    zeroed = _metrics(d.make_run("zero-grad-inside", 5, tmp_path / "z", steps=1))
    clamped = _metrics(d.make_run("clamped-kl", 5, tmp_path / "c", steps=2))
    assert zeroed[1]["grad_norm"] < 0.8 * healthy[1]["grad_norm"]
    assert zeroed[1]["kl"] == 0
    assert clamped[1]["kl"] == 0 and clamped[2]["kl"] > 1.5 * healthy[2]["kl"]


def test_mystery_refuses_a_used_folder_and_a_bad_step_count(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    assert cli(["mystery", "--out", str(tmp_path)]) == 2
    assert cli(["mystery", "--out", str(tmp_path / "new"), "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "exists: choose an empty --out folder" in err and "--steps must be >= 1" in err
    (tmp_path / "a-file").write_text("x")
    assert cli(["mystery", "--out", str(tmp_path / "a-file")]) == 2
    assert "--out: " in capsys.readouterr().err


def test_load_runs_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        d.load_runs(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="holds no runs"):
        d.load_runs(tmp_path)
    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="A is not a mystery run: it has no log.txt, "
                                                "config.json"):
        d.load_runs(tmp_path)


def test_diagnose_checks_the_form_in_the_learners_terms(capsys):
    assert d.diagnose("A") is None
    assert "no diagnosis of run A yet" in capsys.readouterr().out
    with pytest.raises(ValueError, match="cause must be one of healthy, ratio-vs-reference"):
        d.diagnose("A", cause="bad lr", fix="none", evidence="x " * 8)
    with pytest.raises(ValueError, match="evidence must be a sentence of at least 8 words"):
        d.diagnose("A", cause="healthy", fix="none", evidence="looks fine")
    with pytest.raises(ValueError, match="run must be one of A, B"):
        d.diagnose("Z", cause="healthy", fix="none", evidence="x " * 8)


def test_evidence_cites_this_runs_numbers_or_log_not_any_number():
    """With the run's data the evidence point needs a number the run shows (two significant
    digits or more, within 2% or the rounding written) or four words of its log: a learner's
    probe got every point with made-up numbers, the docs' example copied to every run, and
    metric names repeated."""
    runs = d.load_runs()
    j, f, a = (d.citable(runs[name]) for name in ("J", "F", "A"))
    assert d.cites_the_run("kl is 0.0035 at step 1, before any update should happen", j)
    assert not d.cites_the_run("kl is 0.0035 at step 1, before any update should happen", a)
    assert d.cites_the_run("kl is 3.44 by step 10 and 5.8 at the end of the run", f)
    assert not d.cites_the_run("kl jumps to about 5 within two steps and stays up", f)
    assert not d.cites_the_run("grad_norm is 12345.6 at step 999 which is far above normal", f)
    assert not d.cites_the_run("reward reward reward reward reward reward reward reward", f)
    assert not d.cites_the_run("the kl and the loss look wrong in this run compared", a)
    log_words = " ".join(runs["G"].log.split()[-6:])
    assert d.cites_the_run(f"the log ends with {log_words} before training", d.citable(runs["G"]))
    # without the runs (a key with no runs beside it) the form is all that is checked
    assert d.cites_the_run("the kl and the loss look wrong in this run compared", None)
