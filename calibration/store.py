"""The calibration sample store: one SQLite file per user, written by many processes.

Why SQLite in WAL mode: the ranks of a training job (source "run") and a calibration
(source "calibrate") may write at once; WAL lets readers proceed during a write, and each
sample is committed in its own short transaction, so killing a writer at any moment loses
at most the sample in flight. Nothing is pickled: features and info are canonical JSON.

A file that is not ours (another SQLite database, a newer format, garbage bytes, a
damaged page) is refused with one line naming the file and the fix. It is never
"repaired" or recreated: the rows already in it are the user's measurements.
"""
from __future__ import annotations

import json
import math
import os
import random
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar

from neox_perf.prediction import opspec
from neox_perf.errors import PathError

FORMAT_NAME = "neox-perf-samples"
FORMAT_VERSION = 1
SOURCES = ("calibrate", "run")
# The predictors' tables give collectives this single phase (predictors/samples.py).
COLLECTIVE_PHASE = "comm"
COLLECTIVE_FEATURES = ("elements", "gpus_per_node", "nodes")

# Long enough to ride out a burst of ranks committing together; short enough that a
# writer stuck behind a dead lock holder (impossible in WAL, but NFS...) reports it.
BUSY_TIMEOUT_S = 30.0
RETRY_DEADLINE_S = 120.0

_SQLITE_MAGIC = b"SQLite format 3\x00"
_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS devices (
    id          INTEGER PRIMARY KEY,
    key         TEXT NOT NULL UNIQUE,
    fingerprint TEXT NOT NULL,
    created     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id        INTEGER PRIMARY KEY,
    kind      TEXT NOT NULL CHECK (kind IN ('calibrate', 'run')),
    device_id INTEGER REFERENCES devices(id),
    plan      TEXT,
    info      TEXT NOT NULL DEFAULT '{}',
    started   REAL NOT NULL,
    finished  REAL
);
CREATE TABLE IF NOT EXISTS samples (
    id        INTEGER PRIMARY KEY,
    op        TEXT NOT NULL,
    phase     TEXT NOT NULL,
    features  TEXT NOT NULL,
    dtype     TEXT NOT NULL,
    seconds   REAL NOT NULL CHECK (seconds > 0),
    repeats   INTEGER NOT NULL CHECK (repeats >= 1),
    median    REAL NOT NULL,
    iqr       REAL NOT NULL CHECK (iqr >= 0),
    min       REAL NOT NULL,
    device_id INTEGER NOT NULL REFERENCES devices(id),
    run_id    INTEGER NOT NULL REFERENCES runs(id),
    run_scope INTEGER NOT NULL,
    rank      INTEGER NOT NULL DEFAULT 0,
    stage     TEXT,
    source    TEXT NOT NULL CHECK (source IN ('calibrate', 'run')),
    info      TEXT NOT NULL DEFAULT '{}',
    created   REAL NOT NULL,
    UNIQUE (op, phase, features, dtype, device_id, source, run_scope, rank)
);
CREATE INDEX IF NOT EXISTS samples_by_op ON samples (op, device_id, source);
"""


class StoreError(PathError):
    """The sample store cannot be opened or written; one line with the file and the fix."""


@dataclass(frozen=True)
class Sample:
    id: int
    op: str
    phase: str
    features: Dict[str, float]
    dtype: str
    seconds: float
    repeats: int
    median: float
    iqr: float
    min: float
    device_id: int
    run_id: int
    rank: int
    stage: Optional[str]
    source: str
    info: Dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    def to_row(self) -> Dict[str, Any]:
        """The flat dict the predictors' trainer tables are built from."""
        row: Dict[str, Any] = {"op": self.op, "phase": self.phase}
        row.update(self.features)
        row.update(seconds=self.seconds, dtype=self.dtype, stage=self.stage,
                   device_id=self.device_id, source=self.source)
        return row


def canonical_json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _number(name: str, value) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"feature {name!r} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"feature {name!r} must be finite, got {value!r}")
    # 4096 and 4096.0 must be the same point, or a resumed run would re-measure it.
    return int(x) if x.is_integer() else x


def feature_names(op: str) -> tuple:
    if op in opspec.COLLECTIVES:
        return COLLECTIVE_FEATURES
    return tuple(sorted(opspec.op_spec(op).features))


def phases_of(op: str) -> tuple:
    if op in opspec.COLLECTIVES:
        return (COLLECTIVE_PHASE,)
    return opspec.op_spec(op).phases


def canonical_features(op: str, phase: str, features: Mapping[str, Any]) -> str:
    """Validated canonical JSON of one op's features: the exact opspec names, no more, no less."""
    if op not in opspec.OPERATORS and op not in opspec.COLLECTIVES:
        raise ValueError(f"unknown operator {op!r}; known: "
                         f"{', '.join(opspec.OPERATORS + opspec.COLLECTIVES)}")
    if phase not in phases_of(op):
        raise ValueError(f"operator {op!r} has phases {phases_of(op)}, not {phase!r}")
    expected = feature_names(op)
    if tuple(sorted(features)) != expected:
        raise ValueError(f"operator {op!r} takes features {', '.join(expected)}; got "
                         f"{', '.join(sorted(features)) or 'none'}")
    return canonical_json({k: _number(k, v) for k, v in features.items()})


def _locked(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


_SELECT_SAMPLES = ("SELECT id, op, phase, features, dtype, seconds, repeats, median, iqr, min, device_id, "
                   "run_id, rank, stage, source, info, created FROM samples")


def _sample(r) -> Sample:
    return Sample(id=r[0], op=r[1], phase=r[2], features=json.loads(r[3]), dtype=r[4], seconds=r[5],
                  repeats=r[6], median=r[7], iqr=r[8], min=r[9], device_id=r[10], run_id=r[11],
                  rank=r[12], stage=r[13], source=r[14], info=json.loads(r[15]), created=r[16])


class SampleStore:
    """``SampleStore(path)`` opens (creating if missing) a sample store; a context manager."""

    def __init__(self, path, *, busy_timeout: float = BUSY_TIMEOUT_S,
                 retry_deadline: float = RETRY_DEADLINE_S):
        self.path = Path(path)
        self._retry_deadline = retry_deadline
        self._check_header()
        try:
            if not self.path.exists():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout,
                                         isolation_level=None)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(self.path, f"cannot open: {exc}",
                             "check the directory exists and is writable") from None
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            self._retry(self._open)
        except StoreError:
            self._conn.close()
            raise
        except sqlite3.OperationalError as exc:  # permissions, disk full, read-only mount
            self._conn.close()
            raise StoreError(self.path, f"cannot use: {exc}",
                             "check the file and its directory are writable") from None
        except sqlite3.DatabaseError as exc:  # not a database / malformed pages
            self._conn.close()
            raise self._corrupt(exc) from None

    # -- opening -------------------------------------------------------------------------

    def _check_header(self) -> None:
        # sqlite3 happily "opens" any file and fails on first use; check before touching it.
        try:
            with open(self.path, "rb") as fh:
                head = fh.read(len(_SQLITE_MAGIC))
        except FileNotFoundError:
            return
        except IsADirectoryError:
            raise StoreError(self.path, "is a directory, not a sample store",
                             "pass a file path such as calibration.sqlite") from None
        except OSError as exc:
            raise StoreError(self.path, f"cannot read: {exc.strerror}",
                             "check the file permissions") from None
        if head and head != _SQLITE_MAGIC:
            raise StoreError(self.path, "is not a SQLite file, so not a neox-perf sample store",
                             "pass another --store path; this file was left untouched")

    def _corrupt(self, exc: BaseException) -> StoreError:
        return StoreError(self.path, f"is damaged or not a database ({exc})",
                          "move it aside and re-run calibration into a new file; the damaged "
                          "file was left untouched")

    def _open(self) -> None:
        conn = self._conn
        conn.execute("PRAGMA foreign_keys = ON")
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            # Switching needs a moment alone with the file; another opener may hold it.
            conn.execute("PRAGMA journal_mode = WAL")
        # FULL: a committed sample survives a power cut too, not only a killed process.
        conn.execute("PRAGMA synchronous = FULL")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise self._corrupt(RuntimeError(f"integrity check: {check}"))
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "meta" not in tables:
            raise StoreError(self.path, f"is a SQLite database but not a neox-perf sample store "
                                        f"(tables: {', '.join(sorted(tables))})",
                             "pass another --store path; this file was left untouched")
        if not tables:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Re-read under the write lock: a concurrent opener may have created it.
                if not conn.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone():
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)",
                                     [("format", FORMAT_NAME), ("version", str(FORMAT_VERSION)),
                                      ("created", repr(time.time()))])
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        self._check_meta()

    def _check_meta(self) -> None:
        meta = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("format") != FORMAT_NAME:
            raise StoreError(self.path, f"is a SQLite database of format "
                                        f"{meta.get('format')!r}, not a neox-perf sample store",
                             "pass another --store path; this file was left untouched")
        try:
            version = int(meta.get("version", ""))
        except ValueError:
            version = -1
        if version > FORMAT_VERSION:
            raise StoreError(self.path, f"was written by a newer neox-perf (store format "
                                        f"{version}, this version reads {FORMAT_VERSION})",
                             "upgrade neox-perf, or calibrate into a new --store file")
        if version != FORMAT_VERSION:
            raise StoreError(self.path, f"has an unknown store format version {meta.get('version')!r}",
                             "calibrate into a new --store file")

    # -- plumbing ------------------------------------------------------------------------

    def _retry(self, fn: Callable[[], _T]) -> _T:
        """Run fn, retrying while another writer holds the lock beyond busy_timeout."""
        deadline = time.monotonic() + self._retry_deadline
        delay = 0.01
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if not _locked(exc) or time.monotonic() > deadline:
                    if _locked(exc):
                        raise StoreError(self.path, f"still locked after "
                                                    f"{self._retry_deadline:.0f} s ({exc})",
                                         "check no process is stuck writing it; on a network "
                                         "file system put the store on a local disk") from None
                    raise
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)

    def _transaction(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """fn(connection) in one write transaction, committed, or rolled back on any error;
        retried while another writer holds the lock."""
        def once():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self._conn)
                self._conn.execute("COMMIT")
                return out
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        return self._retry(once)

    def _write(self, sql: str, params=()) -> sqlite3.Cursor:
        return self._transaction(lambda conn: conn.execute(sql, params))

    def _read(self, sql: str, params=()) -> list:
        return self._retry(lambda: self._conn.execute(sql, params).fetchall())

    # -- devices and runs ----------------------------------------------------------------

    def register_device(self, fingerprint: Mapping[str, Any]) -> int:
        """Id of the device with this fingerprint, adding it on first sight."""
        text = canonical_json(fingerprint)
        from .fingerprint import fingerprint_id  # no torch import: hashing only
        key = fingerprint_id(fingerprint)
        self._write("INSERT OR IGNORE INTO devices (key, fingerprint, created) VALUES (?, ?, ?)",
                    (key, text, time.time()))
        return int(self._read("SELECT id FROM devices WHERE key = ?", (key,))[0][0])

    def device(self, device_id: int) -> Dict[str, Any]:
        rows = self._read("SELECT fingerprint FROM devices WHERE id = ?", (int(device_id),))
        if not rows:
            raise KeyError(f"no device {device_id} in {self.path}")
        return json.loads(rows[0][0])

    def devices(self) -> Dict[int, Dict[str, Any]]:
        return {int(i): json.loads(fp) for i, fp in self._read("SELECT id, fingerprint FROM devices")}

    def register_run(self, kind: str = "calibrate", *, device: Optional[int] = None,
                     plan: Optional[str] = None, info: Optional[Mapping[str, Any]] = None) -> int:
        """A new run (one calibration or one training job); its id tags the samples it writes."""
        if kind not in SOURCES:
            raise ValueError(f"run kind must be one of {SOURCES}, got {kind!r}")
        cur = self._write("INSERT INTO runs (kind, device_id, plan, info, started) VALUES (?, ?, ?, ?, ?)",
                          (kind, device, plan, canonical_json(dict(info or {})), time.time()))
        return int(cur.lastrowid)

    def finish_run(self, run_id: int, info: Optional[Mapping[str, Any]] = None) -> None:
        if info is None:
            self._write("UPDATE runs SET finished = ? WHERE id = ?", (time.time(), int(run_id)))
        else:
            self._write("UPDATE runs SET finished = ?, info = ? WHERE id = ?",
                        (time.time(), canonical_json(dict(info)), int(run_id)))

    def runs(self) -> List[Dict[str, Any]]:
        rows = self._read("SELECT id, kind, device_id, plan, info, started, finished FROM runs ORDER BY id")
        return [{"id": r[0], "kind": r[1], "device_id": r[2], "plan": r[3], "info": json.loads(r[4]),
                 "started": r[5], "finished": r[6]} for r in rows]

    # -- samples -------------------------------------------------------------------------

    @staticmethod
    def _scope(source: str, run: int) -> int:
        # A calibration point is a property of the device, not of the run that measured it:
        # every calibration run shares scope 0, so a re-run skips it. Training-run samples
        # are kept per run.
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        return 0 if source == "calibrate" else int(run)

    def has_sample(self, op: str, phase: str, features: Mapping[str, Any], *, device: int,
                   dtype: str, source: str = "calibrate", run: int = 0, rank: int = 0) -> bool:
        key = canonical_features(op, phase, features)
        rows = self._read(
            "SELECT 1 FROM samples WHERE op=? AND phase=? AND features=? AND dtype=? AND device_id=? "
            "AND source=? AND run_scope=? AND rank=?",
            (op, phase, key, dtype, int(device), source, self._scope(source, run), int(rank)))
        return bool(rows)

    def add_sample(self, op: str, phase: str, features: Mapping[str, Any], seconds: float, *,
                   device: int, run: int, dtype: str, source: str = "calibrate",
                   repeats: int = 1, median: Optional[float] = None, iqr: float = 0.0,
                   min_seconds: Optional[float] = None, rank: int = 0,
                   stage: Optional[str] = None, info: Optional[Mapping[str, Any]] = None,
                   replace: bool = False) -> bool:
        """Commit one sample in its own transaction. False if that point was already stored
        (``replace``: it is replaced, as a re-timed calibration point is)."""
        key = canonical_features(op, phase, features)
        seconds = float(seconds)
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{op} {phase}: seconds must be positive and finite, got {seconds!r}")
        median = seconds if median is None else float(median)
        min_seconds = seconds if min_seconds is None else float(min_seconds)
        iqr = float(iqr)
        if not (math.isfinite(iqr) and iqr >= 0):
            raise ValueError(f"{op} {phase}: iqr must be finite and >= 0, got {iqr!r}")
        if stage not in (None, "first", "middle", "last", "only"):
            raise ValueError(f"stage must be first, middle, last, only or None, got {stage!r}")
        cur = self._write(
            f"INSERT OR {'REPLACE' if replace else 'IGNORE'} INTO samples (op, phase, features, dtype, "
            "seconds, repeats, median, "
            "iqr, min, device_id, run_id, run_scope, rank, stage, source, info, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (op, phase, key, str(dtype), seconds, int(repeats), median, iqr, min_seconds,
             int(device), int(run), self._scope(source, run), int(rank), stage, source,
             canonical_json(dict(info or {})), time.time()))
        return cur.rowcount == 1

    def flag_disturbed(self, points, flag: Mapping[str, Any], *, device: int, dtype: str) -> int:
        """Mark calibration samples (op, phase, features) as timed while the machine was
        disturbed: ``flag`` goes into their info under "disturbed", in one transaction.
        Returns how many samples were marked."""
        keys = [(op, phase, canonical_features(op, phase, features)) for op, phase, features in points]

        def mark(conn) -> int:
            marked = 0
            for op, phase, key in keys:
                sql = ("FROM samples WHERE op=? AND phase=? AND features=? AND dtype=? AND "
                       "device_id=? AND source='calibrate' AND run_scope=0 AND rank=0")
                params = (op, phase, key, str(dtype), int(device))
                row = conn.execute("SELECT info " + sql, params).fetchone()
                if row is None:
                    continue
                info = {**json.loads(row[0]), "disturbed": dict(flag)}
                conn.execute("UPDATE samples SET info=? WHERE id IN (SELECT id " + sql + ")",
                             (canonical_json(info),) + params)
                marked += 1
            return marked
        return self._transaction(mark)

    def disturbed(self, *, device: int, dtype: Optional[str] = None) -> Dict[tuple, Dict[str, Any]]:
        """The calibration samples of ``device`` (and ``dtype``) still marked disturbed:
        (op, phase, canonical features) -> their mark."""
        sql = ("SELECT op, phase, features, info FROM samples WHERE device_id=? AND source='calibrate' "
               "AND info LIKE '%\"disturbed\"%'")
        params: list = [int(device)]
        if dtype is not None:
            sql += " AND dtype=?"
            params.append(str(dtype))
        out = {}
        for op, phase, features, info in self._read(sql, params):
            mark = json.loads(info).get("disturbed")
            if mark is not None:
                out[(op, phase, features)] = mark
        return out

    def update_run(self, run_id: int, info: Mapping[str, Any]) -> None:
        """Replace a run's info, leaving its start and finish times as they are."""
        self._write("UPDATE runs SET info = ? WHERE id = ?", (canonical_json(dict(info)), int(run_id)))

    def run(self, run_id: int) -> Dict[str, Any]:
        rows = [r for r in self.runs() if r["id"] == int(run_id)]
        if not rows:
            raise KeyError(f"no run {run_id} in {self.path}")
        return rows[0]

    def samples(self, op: Optional[str] = None, device: Optional[int] = None,
                source: Optional[str] = None) -> List[Sample]:
        where, params = [], []
        for column, value in (("op", op), ("device_id", device), ("source", source)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        sql = _SELECT_SAMPLES
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [_sample(r) for r in self._read(sql + " ORDER BY id", params)]

    def calibration_sample(self, op: str, phase: str, features: Mapping[str, Any], *, device: int,
                           dtype: str) -> Optional[Sample]:
        """The calibration sample of one point (None where it is not stored): the one
        ``has_sample`` finds, whole, for a later sweep to pool with."""
        rows = self._read(_SELECT_SAMPLES + " WHERE op=? AND phase=? AND features=? AND dtype=? AND "
                          "device_id=? AND source='calibrate' AND run_scope=0 AND rank=0",
                          (op, phase, canonical_features(op, phase, features), str(dtype), int(device)))
        return _sample(rows[0]) if rows else None

    def rows(self, op: Optional[str] = None, device: Optional[int] = None,
             source: Optional[str] = None) -> List[Dict[str, Any]]:
        """``samples()`` as flat dicts (op, phase, features..., seconds, ...) for the trainer."""
        return [s.to_row() for s in self.samples(op, device, source)]

    def count(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM samples")[0][0])

    def integrity_check(self) -> str:
        return str(self._read("PRAGMA integrity_check")[0][0])

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None

    def __enter__(self) -> "SampleStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SampleStore({os.fspath(self.path)!r})"
