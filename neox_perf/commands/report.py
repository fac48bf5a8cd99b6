"""`neox-perf report RUN_DIR`: predicted vs measured for a run the hook recorded."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .. import exitcodes
from ..errors import UsageError
from .argtypes import positive_int as _positive_int


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


@dataclass
class LogReportResult(PayloadResult):
    """A plain GPT-NeoX training log against the prediction (its own payload and schema)."""
    command: str = "report"
    render_hint: str = "report_log_text"
    schema: str = "report-neox-log"


def add_arguments(parser) -> None:
    """The `report` subcommand's arguments (cli.py calls this on its subparser)."""
    parser.add_argument("run_dir", metavar="RUN_DIR|TRAIN_LOG",
                        help="a run dir written by `neox-perf run`, or GPT-NeoX's own training log "
                             "(with --config: no hook needed)")
    parser.add_argument("--config", dest="configs", nargs="+", metavar="CONFIG",
                        help="the NeoX YAML files the logged run used (a training log only)")
    parser.add_argument("-d", "--conf-dir", help="directory prefixed to every --config (deepy.py -d)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as check --set (a training log only)")
    parser.add_argument("--gpus", type=_positive_int,
                        help="GPUs of the logged run (default: the global_num_gpus it printed)")
    parser.add_argument("--gpus-per-node", type=_positive_int, help="GPUs per node of the logged run")
    parser.add_argument("--vocab-size", type=_positive_int,
                        help="raw tokenizer vocabulary, when the tokenizer file is not readable here")
    parser.add_argument("--cluster", help="cluster to predict with: a name (`neox-perf clusters`), a profile "
                                          "directory or a cluster description YAML "
                                          "(default: the one the run used, else NEOX_PERF_CLUSTER)")
    parser.add_argument("--top", type=int, default=10,
                        help="operators and unmapped events to list (default 10)")
    parser.add_argument("--json", action="store_true", help="print one versioned JSON envelope")


def report_result(run_dir: str, cluster: Optional[str] = None, top: int = 10) -> ReportResult:
    """The report of a run dir. One that is not there, or whose data cannot be reported,
    raises runs.report.ReportError: the data-error exit, as a missing config file has."""
    from ..runs.report import build
    return ReportResult(build(run_dir, cluster=cluster, top=top))


def run_report(args):
    if args.top < 0:
        raise UsageError("--top must be >= 0")
    if os.path.isfile(args.run_dir):  # GPT-NeoX's own training log, no hook
        from ..runs.neox_log_report import build as build_log_report
        from ..runs.report import ReportError
        try:
            return LogReportResult(build_log_report(
                args.run_dir, args.configs or [], cluster=args.cluster, gpus=args.gpus,
                gpus_per_node=args.gpus_per_node, vocab_size=args.vocab_size, sets=args.sets,
                conf_dir=args.conf_dir))
        except ReportError as exc:
            raise UsageError(str(exc)) from None
    if args.configs:
        raise UsageError(f"{args.run_dir}: --config goes with a training log; a run dir records "
                         f"its own config (fix: drop --config, or pass the log file)")
    return report_result(args.run_dir, cluster=args.cluster, top=args.top)
