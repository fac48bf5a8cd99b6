"""`neox-perf plan`: rank the layouts NeoX and DeepSpeed would accept for a model on given GPUs."""
from __future__ import annotations

from ..errors import UsageError


def add_arguments(parser) -> None:
    """The `plan` subcommand's arguments (cli.py calls this on its subparser)."""
    parser.add_argument("configs", nargs="+", metavar="CONFIG",
                        help="NeoX YAML files, merged in order as deepy.py does")
    parser.add_argument("-d", "--conf-dir", help="directory prefixed to every CONFIG (deepy.py -d)")
    parser.add_argument("--gpus", required=True,
                        help="total GPUs of the job, or a comma-separated list (e.g. 64,96,128)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node (default: the cluster's)")
    parser.add_argument("--cluster", required=True,
                        help="cluster profile name, profile directory or cluster YAML")
    parser.add_argument("--vocab-size", type=int,
                        help="raw tokenizer vocabulary, when the tokenizer file is not readable here")
    parser.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    parser.add_argument("--write", metavar="FILE",
                        help="write the best layout as a NeoX YAML overlay of the keys that change")
    parser.add_argument("--json", action="store_true", help="print one versioned JSON envelope")


def run_plan(args):
    raise UsageError("neox-perf plan is not available in this build")
