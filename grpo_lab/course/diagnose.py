"""Diagnose the run (notebook 13): mystery runs, each healthy or broken in one hidden way.

A learner sees what a practitioner sees of a run: its metrics file, the lines it printed and
the config it claims. Every run claims the same config (RUN_CONFIG); what differs is the
code it ran, which `make_runs` chooses from a secret. The key (which run has which cause)
is written to a file apart from the runs and never into them, so neither the runs, the
notebook nor this module holds it: the instructor keeps it, and the grader reads it.

    python -m grpo_lab mystery --out DIR     # DIR/runs/A..J, DIR/key.json (keep it)

`diagnose("C", cause=..., fix=..., evidence=...)` records a learner's answer; the grader
scores it against the key (score_run): the cause 1 point, the fix 1 point, the evidence 1
point when the cause is right and the sentence cites the run (cites_the_run: one of its
numbers, or words of its log).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from .. import naive, objective
from .. import step as step_module
from ..config import METRICS, GRPOConfig
from ..policy import load_policy
from ..step import loss_for
from ..tasks import addition_reward
from ..trainer import Trainer, read_metrics, to_json_line

# What every mystery run claims to be: a correct GRPO at a learning rate the tiny model
# learns at, mu = 1, the batch in 4 micro-batches, no safety net (a broken run shows it).
RUN_CONFIG = dict(steps=60, learning_rate=1e-4, beta=0.04, grad_accum_steps=4,
                  temperature=1.0, eval_every=20, eval_size=128, checkpoint_every=0)
RUN_NAMES = tuple(string.ascii_uppercase[:10])  # A..J
SHIPPED_RUNS = Path(__file__).resolve().parent.parent / "assets" / "mystery-runs"
LOG = "log.txt"
CONFIG = "config.json"
# the columns a run's metrics file keeps (what the trainer logs, nothing about the code)
COLUMNS = ("step", "reward", "reward_std", "frac_reward_zero_std", "loss", "kl",
           "clip_ratio/region_mean", "grad_norm", "entropy", "completions/mean_length",
           "log_ratio/max_abs", "nonfinite_params", "eval/accuracy")

CAUSES = {
    "healthy": "nothing is wrong",
    "ratio-vs-reference": "the ratio is taken against the frozen reference, not the "
                          "sampling policy (reports 000/001)",
    "constant-clip": "the clip term is clip_ratio * advantage, a constant (report 001)",
    "clamped-kl": "the KL is (ref - cur).clamp(0, 10) instead of k3 (report 003's fix)",
    "zero-grad-inside": "zero_grad() inside the micro-batch loop",
    "step-inside": "optimizer.step() inside the micro-batch loop",
    "greedy-sampling": "sampling is greedy: temperature given but sampling not switched on "
                       "(report 003)",
    "pad-token-oov": "a pad token added to the tokenizer has no embedding row (report 002)",
    "lr-100x": "the learning rate applied is 100x the intended one",
    "nan-rewards": "the reward function returns NaN for a completion it cannot parse",
}
FIXES = {
    "none": "change nothing",
    "ratio-vs-old": "take the ratio against the sampling (old) policy",
    "clip-the-ratio": "clip the ratio: min(r * A, clip(r, 1 - eps, 1 + eps) * A)",
    "k3": "estimate the KL with k3 = exp(ref - cur) - (ref - cur) - 1",
    "zero-grad-before-loop": "zero the gradients once, before the micro-batch loop",
    "step-after-loop": "one optimizer step, after the micro-batch loop",
    "enable-sampling": "switch sampling on (do_sample=True) with the temperature",
    "pad-with-eos": "reuse EOS as the pad token (or resize the embeddings)",
    "lower-lr": "apply the intended learning rate (and clip the gradient norm)",
    "validate-rewards": "give an unparseable completion reward 0 and refuse NaN rewards",
}
FIX_OF = dict(zip(CAUSES, FIXES, strict=True))  # the right fix of each cause, in order


# --- the hidden faults: each changes one trainer's code, never its config ----------------------
def _nan_reward(completions, answer, truncated=None, **kw):
    """The report-style parser: int(completion) compared with the answer; NaN where the
    completion is not a number."""
    scores = addition_reward(completions, answer, truncated, **kw)
    return [s if c.strip().isdigit() else float("nan") for s, c in zip(scores, completions,
                                                                      strict=True)]


def _inject(trainer: Trainer, cause: str, stack: contextlib.ExitStack) -> None:
    """Change the functions the trainer's step is given (or its optimizer, or its reward)
    so that the run has `cause` in its code. The claimed config stays as written."""
    t = trainer
    if cause == "ratio-vs-reference":
        t.cfg = t.cfg.replace(ratio_against="reference")  # the code's; the claim stays "old"
        t.use(loss_fn=loss_for(t.cfg))
    elif cause == "constant-clip":
        t.cfg = t.cfg.replace(clip_term="constant")
        t.use(loss_fn=loss_for(t.cfg))
    elif cause == "clamped-kl":
        # the KL term of the step's loss (objective.weighted_loss) is report 003's formula
        stack.enter_context(mock.patch.object(objective, "kl_k3", naive.report003_kl))
    elif cause == "zero-grad-inside":
        loss_of = t.loss_fn

        def zeroed_first(*args):
            t.optimizer.zero_grad(set_to_none=True)  # the bug: earlier micro-batches lost
            return loss_of(*args)
        t.use(loss_fn=zeroed_first)
    elif cause == "step-inside":
        loss_of, update_of = t.loss_fn, t.update_fn
        pending = []

        def loss_then_step(*args):
            if pending:  # the previous micro-batch's update, inside the loop
                t.optimizer.step()
                t.optimizer.zero_grad(set_to_none=True)
                pending.clear()
            pending.append(1)  # its backward follows this loss
            return loss_of(*args)

        def update(run):
            pending.clear()
            return update_of(run)
        t.use(loss_fn=loss_then_step, update_fn=update)
    elif cause == "greedy-sampling":
        sample = step_module.sample_group

        def greedy(model, tok, prompts, g, n, temperature=1.0, top_k=0, top_p=1.0, **kw):
            return sample(model, tok, prompts, g, n, temperature, 1, top_p, **kw)  # top-1
        stack.enter_context(mock.patch.object(step_module, "sample_group", greedy))
    elif cause == "lr-100x":
        for group in t.optimizer.param_groups:
            group["lr"] = group["lr"] * 100
    elif cause == "nan-rewards":
        t.reward_fn = _nan_reward
    elif cause not in ("healthy", "pad-token-oov"):
        raise ValueError(f"cause must be one of {', '.join(CAUSES)} (got {cause!r})")


# --- one run --------------------------------------------------------------------------------
def _row(m: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in m.items() if k in COLUMNS}


def make_run(cause: str, seed: int, out: str | Path, steps: int | None = None) -> Path:
    """Train one mystery run with `cause` hidden in its code; write its metrics, log and
    (claimed) config to `out`. A run that crashes ends there, its error the log's last line."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # the tiny model on any machine: the signatures notebook 13 describes were measured on it
    cfg = GRPOConfig(**{**RUN_CONFIG, "seed": seed, "steps": steps or RUN_CONFIG["steps"],
                        "profile": "cpu"})
    model, tok = load_policy(cfg.profile, cfg.model_path)
    if cause == "pad-token-oov":
        tok.add_special_tokens({"pad_token": "<new-pad>"})  # id == vocab size: no embedding row
    claimed = {k: v for k, v in cfg.to_dict().items() if k in RUN_CONFIG or k in (
        "prompts_per_step", "group_size", "max_new_tokens", "loss_type", "epsilon_low",
        "epsilon_high")}
    (out / CONFIG).write_text(json.dumps(claimed, indent=1, sort_keys=True) + "\n")
    log = [f"training {cfg.steps} steps: {cfg.prompts_per_step} prompts x {cfg.group_size} "
           f"completions per step, {cfg.grad_accum_steps} micro-batches, lr "
           f"{cfg.learning_rate:g}, beta {cfg.beta:g}"]
    rows = []
    with contextlib.ExitStack() as stack:
        trainer = Trainer(cfg, model, tok)
        _inject(trainer, cause, stack)
        try:
            rows.append({"step": 0, "eval/accuracy": trainer.evaluate(), "nonfinite_params": 0})
            log.append(f"step 0: eval accuracy {rows[0]['eval/accuracy']:.3f}")
            while trainer.step_count < cfg.steps:
                m = trainer.step()
                rows.append(m)
                if m["step"] % 10 == 0 or "eval/accuracy" in m:
                    acc = f", eval accuracy {m['eval/accuracy']:.3f}" if "eval/accuracy" in m \
                        else ""
                    log.append(f"step {m['step']}: reward {m['reward']:.3f}, loss "
                               f"{m['loss']:.4f}, kl {m['kl']:.4f}{acc}")
        except Exception as e:  # noqa: BLE001 - what the run printed when it died
            msg = (str(e).splitlines() or [""])[0]
            where = f"step {trainer.step_count + 1}" if rows else "the evaluation at step 0"
            log.append(f"{where} failed: {type(e).__name__}: {msg}")
        else:
            log.append(f"done: {cfg.steps} steps")
    with open(out / METRICS, "w") as f:
        f.writelines(to_json_line(_row(m)) for m in rows)
    (out / LOG).write_text("\n".join(log) + "\n")
    return out


def draw_key(secret: int) -> dict[str, dict]:
    """The secret's mystery set: two healthy runs and eight of the nine faults (one left
    out), shuffled over the run names, each with its own training seed."""
    rng = random.Random(secret)
    faults = [c for c in CAUSES if c != "healthy"]
    causes = ["healthy", "healthy"] + rng.sample(faults, len(faults) - 1)
    rng.shuffle(causes)
    return {name: {"cause": c, "fix": FIX_OF[c], "seed": rng.randrange(2**31)}
            for name, c in zip(RUN_NAMES, causes, strict=True)}


BASELINE = "baseline"  # a healthy run, labelled as one: what the others compare with
BASELINE_SEED = 0


def make_runs(out: str | Path, secret: int | None = None, steps: int | None = None,
              log=print) -> dict:
    """Every run of a secret's set under out/runs/<name>, beside the labelled healthy run
    out/runs/baseline; the key goes to out/key.json (the instructor's: hand out only
    out/runs). `log` gets a line as each run is done (about 7 s each). Returns the key."""
    secret = secrets.randbits(63) if secret is None else secret
    key = draw_key(secret)
    out = Path(out)
    jobs = [(BASELINE, "healthy", BASELINE_SEED)] + [
        (name, e["cause"], e["seed"]) for name, e in key.items()]
    for i, (name, cause, seed) in enumerate(jobs, 1):
        make_run(cause, seed, out / "runs" / name, steps)
        log(f"[mystery] run {name} written ({i} of {len(jobs)})")
    (out / "key.json").write_text(json.dumps({"secret": secret, "runs": key}, indent=1) + "\n")
    return key


# --- what the notebook reads ----------------------------------------------------------------
# short names for the columns of a printed table
LABELS = {"clip_ratio/region_mean": "clip_ratio", "log_ratio/max_abs": "log_ratio_max",
          "frac_reward_zero_std": "zero_std_frac", "nonfinite_params": "nonfinite"}


@dataclass
class Run:
    name: str
    metrics: list[dict]
    log: str
    config: dict

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, over the rows that have it."""
        rows = [m for m in self.metrics if metric in m]
        return [m["step"] for m in rows], [float(m[metric]) for m in rows]

    def table(self, steps=None, columns=("reward", "loss", "kl", "grad_norm",
                                         "clip_ratio/region_mean", "log_ratio/max_abs",
                                         "frac_reward_zero_std", "nonfinite_params")) -> str:
        """The metrics rows of `steps` (default: all), one line each, `columns` only."""
        wanted = None if steps is None else set(steps)
        rows = [m for m in self.metrics if wanted is None or m["step"] in wanted]
        lines = [f"{'step':>4s}  " + "  ".join(f"{LABELS.get(c, c)[:13]:>13s}" for c in columns)]
        for m in rows:
            cells = [f"{m[c]:13.4g}" if isinstance(m.get(c), (int, float)) else f"{'-':>13s}"
                     for c in columns]
            lines.append(f"{m['step']:4d}  " + "  ".join(cells))
        return "\n".join(lines)


def load_runs(folder: str | Path | None = None) -> dict[str, Run]:
    """The runs under `folder` (default: the set shipped with the course), by name."""
    folder = Path(folder) if folder is not None else SHIPPED_RUNS
    if not folder.is_dir():
        raise FileNotFoundError(f"load_runs: {folder} is not a folder; give the runs/ folder "
                                "of a mystery set (python -m grpo_lab mystery --out DIR "
                                "writes DIR/runs)")
    runs = {}
    for d in sorted(p for p in folder.iterdir() if p.is_dir()):
        missing = [f for f in (METRICS, LOG, CONFIG) if not (d / f).is_file()]
        if missing:
            raise FileNotFoundError(f"load_runs: {d} is not a mystery run: it has no "
                                    f"{', '.join(missing)}")
        runs[d.name] = Run(d.name, read_metrics(d), (d / LOG).read_text(),
                           json.loads((d / CONFIG).read_text()))
    if not runs:
        raise FileNotFoundError(f"load_runs: {folder} holds no runs (folders with {METRICS}, "
                                f"{LOG} and {CONFIG})")
    return runs


def summary(runs: dict[str, Run]) -> str:
    """One line per run: how it ended, and each metric's value at step 1 and its median."""
    shown = ("reward", "loss", "kl", "grad_norm", "clip_ratio/region_mean", "log_ratio/max_abs",
             "frac_reward_zero_std", "entropy")
    head = f"{'run':9s} {'steps':>5s} {'accuracy':>17s}  " + "  ".join(
        f"{LABELS.get(c, c):>14s}" for c in shown)
    lines = [head, " " * 35 + "  ".join(f"{'step 1 | median':>14s}" for _ in shown)]
    for name, run in runs.items():
        done = max((m["step"] for m in run.metrics), default=0)
        acc = run.series("eval/accuracy")[1]
        acc_text = f"{acc[0]:.2f} -> {acc[-1]:.2f}" if acc else "-"
        cells = []
        for c in shown:
            steps, values = run.series(c)
            if not values:
                cells.append(f"{'-':>14s}")
                continue
            finite = sorted(v for v in values if math.isfinite(v))
            med = finite[len(finite) // 2] if finite else float("nan")
            cells.append(f"{_short(values[0])}|{_short(med)}".rjust(14))
        lines.append(f"{name:9s} {done:5d} {acc_text:>17s}  " + "  ".join(cells))
    return "\n".join(lines)


def _short(v: float) -> str:
    if not math.isfinite(v):
        return "nan"
    return "0" if v == 0 else f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.0e}"


def plot_metric(runs: dict[str, Run], metric: str, log: bool = False):
    """One panel per mystery run: `metric` against the step, the baseline in grey behind
    it. log=True: a symmetric-log axis (for grad_norm or kl): linear below 1e-3, so a 0
    still shows, as 0."""
    import matplotlib.pyplot as plt

    names = [n for n in runs if n != BASELINE]
    cols = 5
    fig, axes = plt.subplots((len(names) + cols - 1) // cols, cols, figsize=(14, 5),
                             sharex=True, sharey=True, squeeze=False)
    base = runs.get(BASELINE)
    for ax, name in zip(axes.flat, names, strict=False):
        if base is not None:
            ax.plot(*base.series(metric), color="0.7", lw=1.2, label=BASELINE)
        steps, values = runs[name].series(metric)
        ax.plot(steps, values, "-" if len(steps) > 1 else "o", lw=1.0, color="C0", label=name)
        nan = [s for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
        if nan:  # a non-finite value: a red cross on the zero line
            ax.plot(nan, [0] * len(nan), "rx", ms=8)
        if not steps:
            ax.text(0.5, 0.5, "no rows: stopped\nbefore step 1", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9, color="C3")
        ax.set_title(f"run {name}", fontsize=10)
        if log:
            ax.set_yscale("symlog", linthresh=1e-3)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    fig.suptitle(f"{metric} (grey: the baseline, a healthy run)", fontsize=11)
    fig.supxlabel("step", fontsize=9)
    fig.tight_layout()
    return fig


# --- answers and their score ------------------------------------------------------------------
EVIDENCE_WORDS = 8
POINTS = 3  # per run: cause, fix, evidence


@dataclass
class Diagnosis:
    run: str
    cause: str
    fix: str
    evidence: str


def form_problem(run, cause, fix, evidence) -> str | None:
    """What is wrong with the form of an answer (None: well-formed), in the learner's terms."""
    if cause is None and fix is None and evidence is None:
        return f"no diagnosis of run {run} yet: fill in cause=, fix= and evidence="
    if not isinstance(run, str) or run not in RUN_NAMES:
        return f"run must be one of {', '.join(RUN_NAMES)} (got {run!r})"
    if cause not in CAUSES:
        return f"run {run}: cause must be one of {', '.join(CAUSES)} (got {cause!r})"
    if fix not in FIXES:
        return f"run {run}: fix must be one of {', '.join(FIXES)} (got {fix!r})"
    if not isinstance(evidence, str) or len(evidence.split()) < EVIDENCE_WORDS:
        return (f"run {run}: evidence must be a sentence of at least {EVIDENCE_WORDS} words "
                "naming what you saw (a metric, a step, a line of the log)")
    return None


def diagnose(run, cause=None, fix=None, evidence=None) -> Diagnosis | None:
    """Record your diagnosis of one run: its cause (a key of CAUSES), the fix (a key of
    FIXES) and one sentence of evidence from the run. Checks the form only: whether it is
    right is for the grader, who holds the key. Returns None while nothing is filled in."""
    problem = form_problem(run, cause, fix, evidence)
    if problem and problem.startswith("no diagnosis"):
        print(f"⏳ {problem}")
        return None
    if problem:
        raise ValueError(problem)
    print(f"✔ run {run}: {cause} -> {fix} (form checked; the grader holds the key)")
    return Diagnosis(run, cause, fix, evidence)


def citable(run: Run) -> dict:
    """What a sentence can cite of `run`: the values of each of its metrics (every step; of
    the step column only the last, where the run stopped before its planned steps: a
    crash), by the metric's name and its short name, and the words of its log."""
    by_metric: dict[str, set] = {}
    for m in run.metrics:
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and \
                    math.isfinite(v):
                for name in {k, k.split("/")[-1]}:
                    by_metric.setdefault(name, set()).add(abs(float(v)))
    numbers = set().union(*by_metric.values()) if by_metric else set()
    steps = [m["step"] for m in run.metrics if isinstance(m.get("step"), int)]
    if steps and max(steps) < run.config.get("steps", max(steps)):
        numbers.add(float(max(steps)))
    return {"numbers": sorted(numbers), "log": " ".join(_words(run.log)),
            "by_metric": {k: sorted(v) for k, v in by_metric.items()}}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_./]+[a-z0-9_]|[a-z0-9]", text.lower())


CITED_WORDS = 4  # consecutive words of the run's log that count as quoting it
LINKING = {"is", "was", "of", "at", "to", "reaches", "reached", "near", "about", "around"}


def _shows(token: str, values) -> bool:
    """The number written as `token` is one of `values`: within 2%, or within the rounding
    of the digits written; a number of fewer than two significant digits says too little."""
    mantissa = token.split("e")[0]
    if len(mantissa.replace(".", "").lstrip("0")) < 2:
        return False  # 1, 0.5, 0.02: too common to say which run
    x = float(token)
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    half_unit = 0.5 * 10.0 ** -decimals if "e" not in token else 0.0
    return any(abs(x - v) <= max(0.02 * v, half_unit) for v in values)


def cites_the_run(evidence: str, run: dict | None = None) -> bool:
    """The sentence cites the run. With the run's data (`citable(run)`): it holds a number of
    two significant digits or more that the run shows (the named metric's value where a
    metric is named just before it, "kl is 0.0035", else any of its metrics'), or quotes CITED_WORDS
    consecutive words of its log; a made-up number, another run's value, or a step every
    run has does not count. Without it: it names a metric, a step or a log word."""
    words = evidence.lower()
    if run is None:
        names = {c.split("/")[-1] for c in COLUMNS} | {"accuracy", "nan", "crash", "error",
                                                      "indexerror", "ratio", "gradient", "norm"}
        return bool(re.search(r"\bstep\b|\d", words)) or any(n in words for n in names)
    said = _words(evidence)
    by_metric = run.get("by_metric", {})
    for i, token in enumerate(said):
        if not re.fullmatch(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", token):
            continue
        # "kl is 0.0035", "kl 0.0035": the number is that metric's; elsewhere any metric's
        before = said[max(0, i - 2):i]
        named = next((w for j, w in enumerate(before) if w in by_metric
                      and all(x in LINKING for x in before[j + 1:])), None)
        if _shows(token, by_metric[named] if named else run["numbers"]):
            return True
    log = f" {run['log']} "
    return any(f" {' '.join(said[i:i + CITED_WORDS])} " in log
               for i in range(len(said) - CITED_WORDS + 1))


def score_run(answer: dict, truth: dict) -> tuple[int, str]:
    """(points of 3, why) for one run's answer {cause, fix, evidence} against its key entry
    (with the run's `citable` data under "citable" where the grader has the runs)."""
    points, why = 0, []
    if answer.get("cause") == truth["cause"]:
        points += 1
        why.append("cause right")
        evidence = answer.get("evidence")
        if isinstance(evidence, str) and len(evidence.split()) >= EVIDENCE_WORDS and \
                cites_the_run(evidence, truth.get("citable")):
            points += 1
            why.append("evidence cites the run")
        elif truth.get("citable") is not None:
            why.append("evidence cites none of this run's numbers or log lines")
    else:
        why.append("cause wrong")
    if answer.get("fix") == truth["fix"]:
        points += 1
        why.append("fix right")
    else:
        why.append("fix wrong")
    return points, ", ".join(why)


def expected_random_score() -> float:
    """The expected fraction of the points of answers drawn uniformly from CAUSES and
    FIXES with a well-formed evidence sentence, for any key: per run 1/|CAUSES| for the
    cause, as much again for the evidence (it counts only with the right cause), and
    1/|FIXES| for the fix, of 3."""
    return (2 / len(CAUSES) + 1 / len(FIXES)) / 3


def main(out: str, secret: int | None = None, steps: int | None = None) -> int:
    """`python -m grpo_lab mystery --out DIR`: a new mystery set for a class."""
    out_dir = Path(out)
    if (out_dir / "runs").exists():
        raise FileExistsError(f"{out_dir / 'runs'} exists: choose an empty --out folder")
    key = make_runs(out_dir, secret, steps)
    print(f"wrote {len(key)} mystery runs and the baseline to {out_dir / 'runs'}; hand that "
          f"folder out (load_runs(\"{out_dir / 'runs'}\") in notebook 13)")
    print(f"the key is {out_dir / 'key.json'}: keep it; grade with "
          f"--mystery-key {out_dir / 'key.json'}")
    return 0
