"""The neox-perf command line: parse, run a command, render its result, exit with a named code.

Commands return result objects; rendering (rich text or the versioned --json envelope)
happens in one place, so every command speaks the same way and the JSON stays pinned.
Heavy modules (torch, deepspeed) are imported only by the commands that need them.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import List, Optional

from . import __version__, exitcodes
from .commands.argtypes import positive_float as _positive_float, positive_int as _positive_int
from .errors import NeoxPerfError, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code USAGE, like every other problem
        sys.stderr.write(f"neox-perf: usage error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(exitcodes.USAGE)


_COMMANDS = ("check", "calibrate", "validate", "clusters", "plan", "run", "report")

DESCRIPTION = ("Check a GPT-NeoX / DeepSpeed config before you launch it: what it builds, whether "
               "it fits in GPU memory, and how long each iteration and the whole run will take on "
               "your cluster; then compare with the real run.")
# One example per command, shown under its --help (and the first few under neox-perf --help).
EXAMPLES = {
    "check": "neox-perf check my-model.yml my-setup.yml --gpus 96 --cluster dgx-a100",
    "plan": "neox-perf plan my-model.yml --gpus 64,128 --cluster dgx-h100 --write best.yml",
    "clusters": "neox-perf clusters          # profiles and bundled descriptions; --gpus: the GPU table",
    "run": "neox-perf run --cluster dgx-a100 -- python deepy.py train.py my-model.yml",
    "report": "neox-perf report neox-perf-runs/<timestamp>   # or: report train.log --config my-model.yml",
    "calibrate": "neox-perf calibrate --cluster mine --quick",
    "validate": "neox-perf validate my-model.yml --gpus 2 --cluster mine",
}


def _epilog(*commands: str) -> str:
    return "example" + ("s" if len(commands) > 1 else "") + ":\n" + "\n".join(
        f"  {EXAMPLES[c]}" for c in commands)


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """Every subcommand; with `only`, the others' arguments are left out, so a `check` never
    imports the modules that define `plan`, `run` and `report` (check must start fast)."""
    import textwrap
    parser = _Parser(prog="neox-perf", description=textwrap.fill(DESCRIPTION, 78),
                     epilog=_epilog("check", "plan", "clusters", "report")
                     + "\n\nneox-perf COMMAND --help shows a command's options.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"neox-perf {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    check = sub.add_parser("check", help="what a NeoX config builds, whether it fits, how long it takes")
    check.add_argument("configs", nargs="+", metavar="CONFIG",
                       help="NeoX YAML files, merged in order as deepy.py does")
    check.add_argument("-d", "--conf-dir", help="directory prefixed to every CONFIG (deepy.py -d)")
    world = check.add_mutually_exclusive_group()
    world.add_argument("--gpus", type=_positive_int, help="total GPUs of the job")
    world.add_argument("--nodes", type=_positive_int, help="nodes of the job (x GPUs per node)")
    check.add_argument("--gpus-per-node", type=_positive_int,
                       help="GPUs per node (default: the cluster profile's)")
    check.add_argument("--cluster", help="a bundled profile or description by name (dgx-a100, "
                                         "perlmutter-a100: `neox-perf clusters` lists them), a "
                                         "profile directory, or the path of your own cluster "
                                         "description YAML (name, base, gpu, gpus_per_node, "
                                         "intra_node_GBps, inter_node_Gbps)")
    check.add_argument("--vocab-size", type=_positive_int,
                       help="raw tokenizer vocabulary, when the tokenizer file is not readable here")
    check.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key after the merge, value as in YAML (repeatable; "
                            "a.b=v sets one entry of a mapping, e.g. zero_optimization.stage=1)")
    check.add_argument("--max-iteration-seconds", type=_positive_float,
                       help="fail (exit 3) when the predicted iteration is slower than this")
    check.add_argument("--format", choices=("text", "json", "line"), default=None,
                       help="text (default), json (= --json), or line: one line for a job script "
                            "or a log, with a Slurm --time")
    check.add_argument("--json", action="store_true", help="print one versioned JSON envelope")

    calibrate = sub.add_parser("calibrate", help="measure this machine and write a cluster profile, "
                                                 "or correct one from a hooked run (--from-run)")
    calibrate.add_argument("--cluster", required=True,
                           help="name of the profile to write (later: check --cluster NAME)")
    plan = calibrate.add_mutually_exclusive_group()
    plan.add_argument("--quick", action="store_true",
                      help="the bundled quick plan (minutes on a laptop or CI)")
    plan.add_argument("--plan", help="a sampling plan YAML (default: the bundled full plan)")
    plan.add_argument("--from-run", metavar="RUN_DIR",
                      help="refit the profile from a `neox-perf run` directory's samples")
    calibrate.add_argument("--store", help="SQLite sample store (default: "
                                           "$NEOX_PERF_HOME/stores/NAME.sqlite); resumed when present")
    calibrate.add_argument("--out", help="profile directory to write (default: "
                                         "$NEOX_PERF_HOME/profiles/NAME)")
    calibrate.add_argument("--for", dest="for_configs", nargs="+", metavar="CONFIG",
                           help="also sample every operator shape and collective size these NeoX "
                                "configs run (each file one config), and their neighbours")
    calibrate.add_argument("--gpus", type=_positive_int,
                           help="GPUs the --for configs run on (default: --nproc)")
    calibrate.add_argument("--nproc", type=_positive_int,
                           help="processes for the collectives (default: the GPUs here, else 2)")
    calibrate.add_argument("--no-engine", dest="engine", action="store_false",
                           help="skip the DeepSpeed engine step (framework terms)")
    calibrate.add_argument("--json", action="store_true", help="print one versioned JSON envelope")

    validate = sub.add_parser("validate", help="run the reference workload for a config and compare "
                                               "predicted with measured iteration time")
    validate.add_argument("configs", nargs="+", metavar="CONFIG",
                          help="NeoX YAML files, merged in order into one config")
    validate.add_argument("--gpus", type=_positive_int, required=True,
                          help="processes to launch (CPU: one single-threaded process per GPU)")
    validate.add_argument("--cluster", required=True, help="the profile to predict with")
    validate.add_argument("--iters", type=_positive_int, default=10,
                          help="measured iterations after 2 warm-up ones (default 10)")
    validate.add_argument("--vocab-size", type=_positive_int,
                          help="raw tokenizer vocabulary, when the tokenizer file is not readable here")
    validate.add_argument("--neox", metavar="NEOX_SRC",
                          help="measure GPT-NeoX's own deepy.py + train.py from this checkout "
                               "instead of the reference workload")
    validate.add_argument("--json", action="store_true", help="print one versioned JSON envelope")

    clusters = sub.add_parser("clusters", help="list the cluster profiles and their provenance")
    clusters.add_argument("--gpus", action="store_true",
                          help="list the GPUs a cluster description file can name")
    clusters.add_argument("--json", action="store_true", help="print one versioned JSON envelope")

    plan_cmd = sub.add_parser("plan", help="rank the layouts of a model on these GPUs by "
                                           "predicted time to train")
    if only in (None, "plan"):
        from .commands.plan import add_arguments as add_plan_arguments
        add_plan_arguments(plan_cmd)
    run = sub.add_parser("run", help="train with the runtime hook on every rank: "
                                     "neox-perf run [options] -- <launch command>")
    if only in (None, "run"):
        from .commands.run import add_arguments as add_run_arguments
        add_run_arguments(run)
    report = sub.add_parser("report", help="predicted vs measured time of a hooked run")
    if only in (None, "report"):
        from .commands.report import add_arguments as add_report_arguments
        add_report_arguments(report)
    for name, command in sub.choices.items():
        command.epilog = _epilog(name)
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        command.add_argument("--debug", action="store_true",
                             help="on an error, print the traceback before the one-line message")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=words[0] if words and words[0] in _COMMANDS else None)
    try:
        args = parser.parse_args(words)
    except SystemExit as exc:  # --help, --version, or a usage error already reported
        return exc.code if isinstance(exc.code, int) else exitcodes.USAGE
    if args.command is None:
        parser.print_help()
        return exitcodes.USAGE
    fmt = getattr(args, "format", None)
    if fmt and getattr(args, "json", False) and fmt != "json":
        return _fail(args.command, args.command, f"usage error: --json and --format {fmt} "
                     f"disagree (fix: pass one of them)", exitcodes.USAGE, False)
    want_json = bool(getattr(args, "json", False)) or fmt == "json"
    debug = bool(getattr(args, "debug", False))
    # `calibrate --from-run` prints a payload of its own, errors included
    schema_name = "calibrate-from-run" if getattr(args, "from_run", None) else args.command
    try:
        if args.command == "check":
            from .commands.check import run_check
            result = run_check(args)
        elif args.command == "calibrate" and args.from_run:
            if getattr(args, "for_configs", None):
                raise UsageError("--for measures new shapes; --from-run refits from a run's "
                                 "samples: run them as two commands")
            from .commands.from_run import run_from_run
            result = run_from_run(args)
        elif args.command in ("calibrate", "validate"):
            from .render.progress import bars, wanted
            if args.command == "calibrate":
                from .commands.calibrate import run_calibrate as run_command
            else:
                from .commands.validate import check_inputs, run_validate
                check_inputs(args)
                run_command = run_validate
                if getattr(args, "neox", None):  # GPT-NeoX's own train.py as the measured side
                    from .commands.validate_neox import run_validate_neox as run_command
            with bars(wanted(want_json)) as progress:
                result = run_command(args, progress=progress)
        elif args.command == "plan":
            from .commands.plan import run_plan
            result = run_plan(args)
        elif args.command == "clusters":
            from .commands.clusters import run_clusters
            result = run_clusters(args)
        elif args.command == "run":
            from .commands.run import run_run
            result = run_run(args)
        elif args.command == "report":
            from .commands.report import run_report
            result = run_report(args)
        else:  # pragma: no cover - argparse rejects unknown commands
            raise UsageError(f"unknown command {args.command}")
        from .render import emit
        emit(result, want_json, line=fmt == "line")
    except NeoxPerfError as exc:
        code = exitcodes.USAGE if isinstance(exc, UsageError) else exitcodes.INVALID_CONFIG
        return _fail(args.command, schema_name, exc.line(), code, want_json, debug)
    except KeyboardInterrupt:
        return _fail(args.command, schema_name, "interrupted", exitcodes.USAGE, want_json, debug)
    except Exception as exc:  # a bug of ours: one line, the traceback only with --debug
        hint = "" if debug else "; rerun with --debug for the traceback"
        return _fail(args.command, schema_name, f"internal error: {exc.__class__.__name__}: {exc} "
                                                f"(please report it{hint})",
                     exitcodes.INTERNAL, want_json, debug)
    if argv is None and args.command == "check":
        _ending_process()
    return result.exit_code


def _ending_process() -> None:
    """`check` run as a process (the console script, `python -m neox_perf`: main() without
    arguments) exits right after printing. CPython's shutdown then collects garbage over every
    object still tracked -- a check leaves tens of thousands (configs, decompositions, memo
    caches), freed by the exit anyway -- 30-40 ms of a 0.4 s check. gc.freeze moves them to the
    permanent generation, which no collection visits (docs.python.org/3/library/gc.html#gc.freeze).
    A check writes no file and holds nothing whose finalizer must run."""
    import gc
    gc.freeze()


def _fail(command: str, schema_name: str, line: str, code: int, want_json: bool,
          debug: bool = False) -> int:
    if debug:  # called from inside the except block: the exception being handled
        traceback.print_exc(file=sys.stderr)
    sys.stderr.write(f"neox-perf: {line}\n")
    if want_json:
        from .render.envelope import error_envelope, dump
        sys.stdout.write(dump(error_envelope(command, line, code, schema_name)) + "\n")
    return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
