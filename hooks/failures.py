"""One line per failure, once per process: to stderr and to the run dir's errors.log.

Training output is the user's; a hook that floods it or raises into it is worse than no
hook. So whatever goes wrong inside neox-perf is reported once, with where it happened, and
the caller steps aside.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Optional

_lock = threading.Lock()
_reported = False


def _rank() -> str:
    return os.environ.get("RANK", "?")


def report_failure(where: str, exc: BaseException, run_dir: Optional[str] = None) -> bool:
    """Log `exc` unless something was already logged by this process. True if logged now."""
    global _reported
    with _lock:
        if _reported:
            return False
        _reported = True
    line = (f"neox-perf: rank {_rank()}: hook disabled after an error while {where}: "
            f"{exc.__class__.__name__}: {' '.join(str(exc).split())[:300]} "
            f"(training continues without neox-perf)")
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass
    run_dir = run_dir or os.environ.get("PYTHON_NEOX_PERF_RUN_DIR", "").strip()
    if run_dir:
        try:
            os.makedirs(run_dir, exist_ok=True)
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=8))
            with open(os.path.join(run_dir, "errors.log"), "a", encoding="utf-8") as fh:
                # One append per record: concurrent ranks interleave whole records.
                fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid={os.getpid()} {line}\n"
                         + "".join("    " + t + "\n" for t in tb.rstrip().splitlines()))
        except Exception:
            pass
    return True


def already_failed() -> bool:
    return _reported


def _reset_for_tests() -> None:
    global _reported
    _reported = False
