"""Command line: `python -m grpo_lab train ...` and `python -m grpo_lab build-model`.

User mistakes (a bad flag or value) get one line and exit code 2, never a traceback.
A run that crashes prints the real error, then a short diagnosis, and exits 1.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import types
import typing
from pathlib import Path

from . import config
from .config import CHECKPOINT, METRICS, PRESETS, ConfigError, GRPOConfig, preset
from .tools.parser import Parser, UsageError

# config fields that are not flags: set by other means or not meant for the command line
NOT_FLAGS = {"extra", "seed", "steps"}


def _optional_float(name: str):
    def parse(text: str) -> float | None:
        if text.lower() in ("none", "off"):
            return None
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} takes a number or 'none' (got {text!r})"
            ) from None

    return parse


def _field_flag(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    flag = "--" + f.name.replace("_", "-")
    hint = typing.get_type_hints(GRPOConfig)[f.name]
    doc = FIELD_DOCS.get(f.name, "")
    if hint is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=doc)
    elif hint in (int, float, str):
        parser.add_argument(flag, type=hint, default=None, help=doc)
    elif isinstance(hint, types.UnionType) and float in typing.get_args(hint):
        parser.add_argument(flag, type=_optional_float(flag), default=None, help=doc,
                            metavar="X|none")
    else:  # str | None
        parser.add_argument(flag, type=str, default=None, help=doc)


def _field_docs() -> dict[str, str]:
    """The docstring under each GRPOConfig field, for --help."""
    tree = ast.parse(inspect.getsource(config))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOConfig")
    docs, last = {}, None
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            last = node.target.id
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and last:
            docs[last] = " ".join(str(node.value.value).split()).replace("%", "%%")
            last = None
    return docs


FIELD_DOCS = _field_docs()


def build_parser() -> Parser:
    parser = Parser(prog="python -m grpo_lab", description="GRPO Lab command line")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    train = sub.add_parser("train", help="train with a preset; writes metrics, plot, checkpoints")
    train.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="naive (the field reports' setup) or stable (every fix on)")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    train.add_argument("--seed", type=int, default=None, help="run seed (default 0)")
    train.add_argument("--out", type=Path, required=True, help="output directory")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its checkpoint")
    train.add_argument("--config", type=Path, default=None,
                       help="JSON file of config fields applied on top of the preset")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    for f in dataclasses.fields(GRPOConfig):
        if f.name not in NOT_FLAGS:
            _field_flag(train, f)

    yours = sub.add_parser(
        "yours", help="train with YOUR step and loss, read from your notebooks (notebooks "
                      "04 on); a crash prints the error and a diagnosis, and exits 1")
    yours.add_argument("--preset", choices=sorted(PRESETS), default="stable",
                       help="the config your step reads (default stable)")
    yours.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    yours.add_argument("--seed", type=int, default=None, help="run seed (default 0)")
    yours.add_argument("--step", default="grpo_step",
                       help="your step function: an exercise name (default grpo_step)")
    yours.add_argument("--loss", default="grpo_loss",
                       help="the loss your step calls: an exercise name such as grpo_loss, "
                            "reinforce_loss, reported_loss (default grpo_loss)")
    yours.add_argument("--update", default=None,
                       help="the update your step calls after backward: an exercise name "
                            "(default: your step's own default)")
    yours.add_argument("--notebooks", type=Path, default=Path("."),
                       help="the folder holding your notebooks (default: the current one)")
    yours.add_argument("--out", type=Path, required=True, help="output directory")
    yours.add_argument("--config", type=Path, default=None,
                       help="JSON file of config fields applied on top of the preset")
    yours.add_argument("--no-progress", action="store_true", help="no progress bar")
    for f in dataclasses.fields(GRPOConfig):
        if f.name not in NOT_FLAGS:
            _field_flag(yours, f)

    scen = sub.add_parser("scenario", help="reproduce a field failure (or show its fix)")
    scen.add_argument("name", nargs="?", help="scenario name (see --list)")
    scen.add_argument("--list", action="store_true", help="list the scenarios")
    scen.add_argument("--fixed", action="store_true", help="run the fix instead of the bug")
    scen.add_argument("--device", default=None,
                      help="run it on this device ('cuda') in a fresh process; for the "
                           "scenarios that fail in the device's kernels (000, 002)")

    sub.add_parser("reliability", help="run every scenario, fault, bad input and resume check")
    grade = sub.add_parser("grade", help="grade submitted notebooks with the exercise checkers")
    grade.add_argument("notebooks", nargs="+", help="submitted .ipynb files")
    grade.add_argument("--json", default=None, help="write the records as JSON here")
    grade.add_argument("--csv", default=None,
                       help="write the gradebook here: one row per student, one column per "
                            "exercise, total and max")
    grade.add_argument("--feedback", default=None, metavar="DIR",
                       help="write one Markdown feedback file per student into DIR")
    grade.add_argument("--journal", default=None, metavar="FILE",
                       help="append-only record of finished submissions (default: next to "
                            "--json, else grades.journal.jsonl); a restarted grader skips "
                            "what it holds")
    grade.add_argument("--cell-timeout", type=int, default=60,
                       help="seconds one step of a submission (running its exercise cell, "
                            "one call of its function) may take before it counts as hung")
    grade.add_argument("--submission-timeout", type=int, default=600,
                       help="seconds all the steps of one submission may take together")
    grade.add_argument("--memory-mb", type=int, default=4096,
                       help="address-space limit of the process running a submission")
    grade.add_argument("--hints", action="store_true",
                       help="also count the hints each student opened (hint(\"name\") in the "
                            "notebook, two tiers per exercise): a gradebook column and a line per "
                            "exercise in the feedback; never part of a grade")
    grade.add_argument("--mystery-key", default=None, metavar="FILE",
                       help="the key of the mystery runs notebook 13 diagnoses (key.json "
                            "from `mystery`; default: the course's own set, whose key is in "
                            "solutions/13)")
    mystery = sub.add_parser("mystery", help="make a new set of mystery runs for notebook 13 "
                                             "(runs to hand out, and a key to keep)")
    mystery.add_argument("--out", required=True, help="an empty folder: OUT/runs, OUT/key.json")
    mystery.add_argument("--secret", type=int, default=None,
                         help="the secret that draws the set (default: a random one, "
                              "written into the key)")
    mystery.add_argument("--steps", type=int, default=None,
                         help="steps per run (default 60, what notebook 13 describes)")
    labs = sub.add_parser("labs", help="generate labs/ from solutions/ (student versions)")
    labs.add_argument("--check", action="store_true", help="exit 1 when labs/ is out of sync")
    labs.add_argument("--root", default=None,
                      help="the course repository (default: found from the current directory)")
    labs.add_argument("--nbgrader", default=None, metavar="DIR",
                      help="write an nbgrader source folder (DIR/source/<assignment>/) from "
                           "solutions/ instead")
    labs.add_argument("--assignment", default="grpo_lab",
                      help="the nbgrader assignment name (with --nbgrader)")
    nbs = sub.add_parser("notebooks", help="execute solutions/ notebooks and store outputs")
    nbs.add_argument("paths", nargs="*", help="notebooks (default: solutions/*.ipynb)")

    # listed for --help only: main() hands everything after "memory" or "bench" to their
    # own parsers (each also runs as python -m grpo_lab.tools.memory / grpo_lab.tools.bench)
    sub.add_parser("memory", help="peak memory of one step against batch, G, completion "
                                  "length, accumulation and activation checkpointing "
                                  "(python -m grpo_lab memory --help)")
    sub.add_parser("bench", help="grpo_lab against TRL's GRPOTrainer on the same work "
                                 "(python -m grpo_lab bench --help)")

    build = sub.add_parser("build-model", help="regenerate the shipped tiny GPT-2")
    build.add_argument("--out", type=Path, default=None)
    return parser


def _config_from_args(args) -> GRPOConfig:
    overrides: dict = {}
    if args.config is not None:
        try:
            loaded = json.loads(args.config.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--config {args.config}: {e}") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"--config {args.config}: must hold a JSON object of config fields")
        overrides.update(loaded)
        known = {f.name for f in dataclasses.fields(GRPOConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UsageError(f"--config {args.config}: unknown config field {unknown[0]!r}")
    for f in dataclasses.fields(GRPOConfig):
        if f.name not in NOT_FLAGS and getattr(args, f.name, None) is not None:
            overrides[f.name] = getattr(args, f.name)
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.steps is not None:
        overrides["steps"] = args.steps
    cfg = preset(args.preset, **overrides)
    # the profile this run resolves ($GRPO_LAB_PROFILE, else cpu), so that config.json names
    # the model that trains and --resume in a shell with another $GRPO_LAB_PROFILE is refused
    return cfg.replace(profile=config.resolve_profile(cfg.profile))


def _refuse_changes(args, saved: dict) -> None:
    """--resume continues the saved config: flags that repeat it are fine (the same command
    with --resume appended), a flag that differs is refused with both values."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig)
             if f.name not in NOT_FLAGS and getattr(args, f.name, None) is not None}
    if args.seed is not None:
        given["seed"] = args.seed
    if args.config is not None and args.preset is None:
        raise UsageError("--resume with --config needs the run's --preset too, to compare "
                         "them with the saved config")
    if args.preset is not None:
        # the whole config the command describes, as a fresh run would have built it
        asked = _config_from_args(args).to_dict()
        given = {**{k: v for k, v in asked.items() if k != "steps"}, **given}
    differ = [
        f"--{name.replace('_', '-')} (saved {saved.get(name)!r}, got {value!r})"
        for name, value in given.items() if name != "extra" and saved.get(name) != value
    ]
    if differ:
        raise UsageError(
            "--resume continues the run with its saved config; only --steps may change, and "
            "these flags differ from it: " + ", ".join(differ)
        )


def cmd_train(args) -> int:
    out: Path = args.out
    has_run = (out / CHECKPOINT).exists() or (out / METRICS).exists()
    if args.resume:
        if not (out / CHECKPOINT).exists():
            raise UsageError(f"--resume: no {CHECKPOINT} in {out} to continue from")
        try:
            saved = json.loads((out / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--resume: cannot read {out / 'config.json'}: {e}") from None
        _refuse_changes(args, saved)
        if args.steps is not None:
            saved["steps"] = args.steps
        cfg = GRPOConfig.from_dict(saved)
    else:
        if args.preset is None:
            raise UsageError("the following arguments are required: --preset")
        cfg = _config_from_args(args)
        if has_run:
            raise UsageError(
                f"--out {out} already holds a run; add --resume to continue it or pick a new --out"
            )

    if cfg.model_path is not None:
        config.saved_model_dir(cfg.model_path)
    # torch and transformers load only now, so a bad flag is answered at once
    from . import distributed
    from .course.plots import plot_run
    from .models import requested_device
    from .trainer import Trainer

    # the device this run trains on decides whether the GPUs' count matters (the cpu profile
    # trains on the CPU, however many GPUs the machine has)
    problem = distributed.launch_problem(requested_device(cfg.device, cfg.profile))
    if problem:
        raise UsageError(problem)
    try:
        trainer = Trainer(cfg, out_dir=out)
        main_rank = trainer.world.is_main
        if main_rank:
            out.mkdir(parents=True, exist_ok=True)
        if args.resume:
            trainer.load_checkpoint()
            if main_rank:
                print(f"[grpo_lab] resuming {out} at step {trainer.step_count} of {cfg.steps}")
        elif main_rank:
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    except (ConfigError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    except Exception as e:
        print(f"error while setting up the run: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if trainer.world.distributed and main_rank:
        print(f"[grpo_lab] data-parallel: {trainer.world.world_size} processes, "
              f"{cfg.prompts_per_step // trainer.world.world_size} prompts each per step")
    plot_path = out / "metrics.png"
    failed = True
    try:
        trainer.train(progress=not args.no_progress)
        failed = False
    except Exception as e:
        print(f"\nerror at step {trainer.step_count + 1}: {type(e).__name__}: {e}",
              file=sys.stderr)
        if main_rank:
            print("diagnosis:\n  " + trainer.diagnosis().replace("\n", "\n  "),
                  file=sys.stderr)
            plot_run(trainer.history, plot_path, title=f"{args.preset} (crashed)")
            print(f"metrics: {out / METRICS}  plot: {plot_path}", file=sys.stderr)
        return 1
    finally:
        trainer.close(failed)
    if not main_rank:
        return 0
    plot_run(trainer.history, plot_path, title=args.preset)
    evals = [m["eval/accuracy"] for m in trainer.history if "eval/accuracy" in m]
    print(
        f"[grpo_lab] done: {trainer.step_count} steps, eval/accuracy {evals[0]:.3f} -> "
        f"{evals[-1]:.3f}; metrics: {out / METRICS}  plot: {plot_path}  "
        f"checkpoint: {out / CHECKPOINT}"
    )
    return 0


def cmd_yours(args) -> int:
    """Your trainer, outside the notebook: the functions come from your notebook files
    (workbook.load_yours: yours where they pass their checks, else the references)."""
    cfg = _config_from_args(args)
    if (args.out / METRICS).exists():
        raise UsageError(f"--out {args.out} already holds a run; pick a new --out")
    if not args.notebooks.is_dir():
        raise UsageError(f"--notebooks {args.notebooks}: not a folder")
    from functools import partial

    from .course.plots import plot_run
    from .course.steps import diagnosis, new_run, step_label, train
    from .course.workbook import exercise_index, load_yours

    known = exercise_index()
    for flag, name in (("--step", args.step), ("--loss", args.loss), ("--update", args.update)):
        if name is not None and name not in known:
            raise UsageError(f"{flag} {name!r} is not an exercise of the course")
    names = [args.step, args.loss] + ([args.update] if args.update is not None else [])
    step, loss, *update = load_yours(*names, folder=args.notebooks,
                                     elsewhere="pass --notebooks DIR")
    kwargs = {"loss_fn": loss} | ({"update_fn": update[0]} if update else {})
    run = new_run(cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    plot_path = args.out / "metrics.png"
    step = partial(step, **kwargs)
    title = f"{step_label(step)}, {args.preset}"  # says so when a reference stands in
    try:
        train(run, step, progress=not args.no_progress, metrics_path=args.out / METRICS)
    except Exception as e:
        print(f"\nerror at step {run.step_count + 1}: {type(e).__name__}: {e}", file=sys.stderr)
        print("diagnosis:\n  " + diagnosis(run).replace("\n", "\n  "), file=sys.stderr)
        plot_run(run.history, plot_path, title=f"{title} (crashed)")
        print(f"metrics: {args.out / METRICS}  plot: {plot_path}", file=sys.stderr)
        return 1
    plot_run(run.history, plot_path, title=title)
    evals = [m["eval/accuracy"] for m in run.history if "eval/accuracy" in m]
    print(f"[grpo_lab] done: {run.step_count} steps, eval/accuracy {evals[0]:.3f} -> "
          f"{evals[-1]:.3f}; metrics: {args.out / METRICS}  plot: {plot_path}")
    return 0


def cmd_scenario(args) -> int:
    """Exit 0 when the scenario did what it promises: the symptom without --fixed, no
    symptom with it; 1 otherwise. Listing and refusing need only the catalog (no torch)."""
    from .field.catalog import CATALOG, DEVICE_SCENARIOS, describe

    if args.list or not args.name:
        if not args.list:
            raise UsageError("give a scenario name, or --list")
        print("\n\n".join(describe(s) for s in CATALOG.values()))
        return 0
    if args.name not in CATALOG:
        raise UsageError(f"unknown scenario {args.name!r}; allowed: {', '.join(CATALOG)}")
    if args.device is not None:
        if args.name not in DEVICE_SCENARIOS:
            raise UsageError(f"--device: scenario {args.name!r} runs on CPU only; allowed "
                             f"with --device: {', '.join(DEVICE_SCENARIOS)}")
        try:
            config.check_device_name(args.device)
            from .models import resolve_device

            resolve_device(args.device)
        except ConfigError as e:  # "device must be ...": the flag's name in front
            raise UsageError(f"--{e}") from None
    print(describe(CATALOG[args.name]))
    from .field.scenarios import Outcome, run_on_device, run_scenario

    after = None
    if args.device is None:
        outcome = run_scenario(args.name, fixed=args.fixed)
    else:
        result = run_on_device(args.name, args.fixed, args.device)
        outcome, after = Outcome(result["symptom"], result["evidence"]), result["after"]
    side = "fixed" if args.fixed else "broken"
    expected = outcome.symptom != args.fixed
    print("\n" + outcome.line(side))
    if after is not None:
        print(f"[{side}] on {args.device}, in a fresh process; the next operation on the "
              f"device there: {after}")
    if not expected:
        print(f"unexpected: the {side} variant should "
              f"{'not ' if args.fixed else ''}show the symptom", file=sys.stderr)
    return 0 if expected else 1


def cmd_build_model(args) -> int:
    from .models import TINY_MODEL_DIR
    from .tools.warmstart import build_tiny_model

    build_tiny_model(args.out or TINY_MODEL_DIR)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .tools.bench import main as bench

        return bench(argv[1:])
    if argv[:1] == ["memory"]:
        from .tools.memory import main as memory

        return memory(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "train":
            return cmd_train(args)
        if args.command == "scenario":
            return cmd_scenario(args)
        if args.command == "yours":
            return cmd_yours(args)
        if args.command == "grade":
            for flag, value, least in (("--cell-timeout", args.cell_timeout, 1),
                                       ("--submission-timeout", args.submission_timeout, 1),
                                       ("--memory-mb", args.memory_mb, 512)):
                if value < least:
                    raise UsageError(f"{flag} must be >= {least} (got {value})")
            from .course.grade import main as grade

            return grade(args.notebooks, args.json, args.csv, args.cell_timeout,
                         journal=args.journal, feedback=args.feedback,
                         submission_timeout=args.submission_timeout, memory_mb=args.memory_mb,
                         hints=args.hints, mystery_key=args.mystery_key)
        if args.command == "mystery":
            from .course.diagnose import main as mystery

            if args.steps is not None and args.steps < 1:
                raise UsageError(f"--steps must be >= 1 (got {args.steps})")
            try:
                return mystery(args.out, args.secret, args.steps)
            except OSError as e:  # the folder exists, is a file, or cannot be written
                raise UsageError(f"--out: {e}") from None
        if args.command == "labs":
            from .course.labs import main as labs

            try:
                return labs(check=args.check, root=args.root, nbgrader=args.nbgrader,
                            assignment=args.assignment)
            except FileNotFoundError as e:
                raise UsageError(str(e)) from None
        if args.command == "notebooks":
            from .course.notebooks import main as notebooks

            return notebooks(args.paths)
        if args.command == "reliability":
            from .field.reliability import main as reliability

            return reliability()
        return cmd_build_model(args)
    except (UsageError, ConfigError) as e:
        print(f"grpo_lab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
