"""Helpers for the hook tests (imported by basename, like tests/workload's workload_specs)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRACES = HERE / "traces"
sys.path.insert(0, str(HERE.parent / "workload"))  # workload_specs, shared with tests/workload
TIMEOUT = 900


def load_trace(name):
    from neox_perf.hooks.trace_map import Dims, Event, Groups, MapContext
    data = json.loads((TRACES / name).read_text())
    c = data["context"]
    ctx = MapContext(dims=Dims(**c["dims"]), groups=Groups(**c["groups"]), device=c["device"],
                     dtype=c["dtype"], optimizer_params=c["optimizer_params"])
    return [Event.from_dict(e) for e in data["events"]], ctx


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra):
    # The user's own switch or default cluster must not leak into the tests' launches.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON_NEOX_PERF_") and k != "NEOX_PERF_CLUSTER"}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run(cmd, env, cwd, timeout=TIMEOUT):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return proc


def cli(argv, cwd, env=None):
    """`neox-perf ARGV` in a subprocess: through the CLI once the lead has wired run/report,
    until then through the command functions and the same render layer (tests/hooks/_cli.py)."""
    from neox_perf.cli import build_parser
    choices = build_parser()._subparsers._group_actions[0].choices
    if argv[0] in choices:
        cmd = [sys.executable, "-m", "neox_perf.cli", *argv]
    else:
        cmd = [sys.executable, str(HERE / "_cli.py"), *argv]
    return run(cmd, env or base_env(), cwd)
