"""`neox-perf report RUN_DIR`: predicted vs measured for a run the hook recorded."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .. import exitcodes
from ..errors import UsageError


@dataclass
class PayloadResult:
    """A command result that is plain data already: its JSON payload as it is."""

    payload: dict = field(default_factory=dict)
    command: str = ""
    render_hint: str = ""
    exit_code: int = exitcodes.OK

    def to_dict(self) -> dict:
        return self.payload


@dataclass
class ReportResult(PayloadResult):
    command: str = "report"
    render_hint: str = "report_text"


def add_arguments(parser) -> None:
    """The `report` subcommand's arguments (cli.py calls this on its subparser)."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run dir written by `neox-perf run`")
    parser.add_argument("--cluster", help="cluster profile name or directory to predict with "
                                          "(default: the one the run used, else NEOX_PERF_CLUSTER)")
    parser.add_argument("--top", type=int, default=10,
                        help="operators and unmapped events to list (default 10)")
    parser.add_argument("--json", action="store_true", help="print one versioned JSON envelope")


def report_result(run_dir: str, cluster: Optional[str] = None, top: int = 10) -> ReportResult:
    """The report of a run dir. One that is not there is a usage error; one whose data cannot
    be reported raises runs.report.ReportError (the data-error exit)."""
    from ..runs.report import build
    if not os.path.isdir(run_dir):
        raise UsageError(f"{os.path.abspath(run_dir)}: no such run dir")
    return ReportResult(build(run_dir, cluster=cluster, top=top))


def run_report(args) -> ReportResult:
    if args.top < 0:
        raise UsageError("--top must be >= 0")
    return report_result(args.run_dir, cluster=args.cluster, top=args.top)
