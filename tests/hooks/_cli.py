"""`neox-perf run|report` for the tests until cli.py wires them: the same command functions,
the same render layer, the same one-line errors and exit codes as neox_perf.cli.main."""
import argparse
import sys

from neox_perf import exitcodes
from neox_perf.commands import report, run
from neox_perf.errors import NeoxPerfError
from neox_perf.render import emit


def main(argv):
    parser = argparse.ArgumentParser(prog="neox-perf")
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_arguments(sub.add_parser("run"))
    report.add_arguments(sub.add_parser("report"))
    args = parser.parse_args(argv)
    try:
        result = run.run_run(args) if args.command == "run" else report.run_report(args)
    except NeoxPerfError as exc:
        sys.stderr.write(f"neox-perf: {exc.line()}\n")
        return exitcodes.USAGE
    emit(result, args.json)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
