"""`neox-perf run [--run-dir DIR] [--cluster NAME] -- <launch command>`: train with the hook on.

The launch command runs unchanged (deepspeed, torchrun, python deepy.py, srun ...) with
the hook's switch in its environment: our sitecustomize directory first on PYTHONPATH and
PYTHON_NEOX_PERF_RUN_DIR set. Both names start with PYTHON, which DeepSpeed's multi-node
runners export to remote ranks; torchrun and DeepSpeed's local launcher pass the whole
environment. When the command ends, the report is built from the run dir.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from ..errors import UsageError
from .report import PayloadResult

DEFAULT_ROOT = "neox-perf-runs"


@dataclass
class RunResult(PayloadResult):
    command: str = "run"
    render_hint: str = "report_text"


def add_arguments(parser) -> None:
    """The `run` subcommand's arguments (cli.py calls this on its subparser)."""
    import argparse
    parser.add_argument("--run-dir", help=f"where the run's artefacts go "
                                          f"(default ./{DEFAULT_ROOT}/<timestamp>)")
    parser.add_argument("--cluster", help="cluster to predict with: a name (`neox-perf clusters`), a profile "
                                          "directory or a cluster description YAML "
                                          "(default: NEOX_PERF_CLUSTER; none: no prediction)")
    parser.add_argument("--windows", help="profiling windows, e.g. skip=5,warmup=1,active=2,"
                                          "every=50,repeat=3, or off")
    parser.add_argument("--neox-config", nargs="+", metavar="YML", default=None,
                        help="NeoX config of a script that is not GPT-NeoX (NeoX passes its own)")
    parser.add_argument("--vocab-size", type=int, help="raw tokenizer vocabulary for --neox-config")
    parser.add_argument("--json", action="store_true", help="print one versioned JSON envelope")
    parser.add_argument("launch", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the launch command, after --")


def default_run_dir(now: float = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return os.path.abspath(os.path.join(DEFAULT_ROOT, stamp))


def _check_cluster(cluster):
    if not cluster:
        return
    from ..prediction.predict import load_cluster
    try:
        load_cluster(cluster)
    except UsageError as exc:
        raise UsageError(f"cluster profile {cluster!r} not usable ({exc}); fix --cluster") from None


def run_run(args) -> RunResult:
    from ..hooks import settings
    from ..runs.files import RUN_FILE, write_json_atomic
    command = list(args.launch or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no launch command: use `neox-perf run [options] -- deepspeed train.py ...`")
    cluster = args.cluster or os.environ.get(settings.USER_CLUSTER) or None
    _check_cluster(cluster)
    run_dir = os.path.abspath(args.run_dir or default_run_dir())
    if any(c.isspace() for c in run_dir):
        # pdsh-launched ranks receive `export NAME=value;` unquoted (DeepSpeed's PDSHRunner).
        raise UsageError(f"run dir {run_dir!r} contains a space; DeepSpeed's pdsh runner would "
                         f"split it; pick another --run-dir")
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create run dir {run_dir}: {exc.strerror}") from None
    job = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    try:
        env_vars = settings.environment(run_dir, cluster=cluster, job=job, windows=args.windows,
                                        config_files=args.neox_config, vocab=args.vocab_size,
                                        report_at_exit=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    info = {"command": command, "job": job, "cluster": cluster, "started": time.time(),
            "cwd": os.getcwd(), "environment": env_vars, "exit_code": None}
    run_file = os.path.join(run_dir, RUN_FILE)
    write_json_atomic(run_file, info)
    sys.stderr.write(f"neox-perf: recording into {run_dir} (job {job})\n")
    sys.stderr.flush()
    code = _launch(command, {**os.environ, **env_vars})
    info.update(exit_code=code, finished=time.time())
    write_json_atomic(run_file, info)
    payload = {"run": {k: info[k] for k in ("command", "job", "cluster", "exit_code")},
               "run_dir": run_dir, "report": None, "report_error": None}
    from ..runs.report import ReportError, build
    try:
        payload["report"] = build(run_dir, cluster=cluster)
    except ReportError as exc:
        payload["report_error"] = str(exc)
    # The launch command's own status is the answer to "did training work".
    return RunResult(payload, exit_code=code)


def _launch(command, env) -> int:
    try:
        proc = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise UsageError(f"cannot start {command[0]!r}: {exc.strerror}") from None
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:
            # The terminal sent SIGINT to the launcher too; let it shut its ranks down.
            continue
    return code if code >= 0 else 128 - code
