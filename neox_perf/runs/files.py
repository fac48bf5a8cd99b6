"""The run dir's files: where the hook writes them and how they are read back.

Written inside the ranks (hooks/) so that a reader never sees half a file, read offline by
the report and recalibration (runs/):

    rank-00003.json              summary (atomic: write a temp file, fsync, rename)
    rank-00003.iterations.jsonl  one line per iteration (timing.py)
    samples-<host>.sqlite        operator samples of every rank on that node (calibration/store.py)
    errors.log                   one record per failure (failures.py)
    run.json                     what `neox-perf run` launched (commands/run.py)
"""
from __future__ import annotations

import glob
import json
import os
import re
import tempfile
from typing import Any, Dict, List

SCHEMA = "neox-perf.hook-rank/1"
STORE_GLOB = "samples-*.sqlite"


def store_file(run_dir: str, host: str) -> str:
    """One store per node: SQLite's WAL mode needs every writer on one host (its shared
    memory index does not work across a network file system), and a multi-node run dir is
    normally on one. Ranks of a node share their node's file."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", host or "localhost")
    return os.path.join(run_dir, f"samples-{safe}.sqlite")


def store_files(run_dir: str) -> List[str]:
    return sorted(glob.glob(os.path.join(run_dir, STORE_GLOB)))


RUN_FILE = "run.json"


def rank_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank:05d}.json")


def iterations_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank:05d}.iterations.jsonl")


def write_json_atomic(path: str, data: Dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(clean(data), fh, indent=1, allow_nan=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def clean(value):
    """JSON has no inf/nan: a value that could not be measured is null."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def read_rank_summaries(run_dir: str) -> List[Dict[str, Any]]:
    out = []
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return out
    for name in names:
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(run_dir, name), encoding="utf-8") as fh:
                    data = json.load(fh)
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("schema") == SCHEMA:
                out.append(data)
    return sorted(out, key=lambda d: d.get("rank", 0))


def _read_lines(path: str, parse):
    """[parse(record)] of a JSON-lines file's records; a record ``parse`` cannot read (a torn
    last line, a field of the wrong type) is skipped, and so is one it maps to None."""
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    item = parse(json.loads(line))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
                if item is not None:
                    out.append(item)
    except FileNotFoundError:
        pass
    return out


def read_iteration_phases(path: str):
    """[(index, seconds, {phase: seconds})] of the iterations timed outside profiling windows
    that carry per-phase wall time (CPU ranks)."""
    def parse(rec):
        ph = rec.get("ph")
        if not isinstance(ph, dict) or rec.get("p", 0):
            return None
        return int(rec["i"]), float(rec["s"]), {str(k): float(v) for k, v in ph.items()}
    return _read_lines(path, parse)


def read_iterations(path: str):
    """[(index, seconds, profiled)] from a JSON-lines file; a torn last line is skipped."""
    return _read_lines(path, lambda rec: (int(rec["i"]), float(rec["s"]), bool(rec.get("p", 0))))
