"""Reading the published operator / NCCL samples into per-(op, phase) training sets.

The CSVs are read with the csv module and numpy only. A malformed file (unknown header,
text in a number, no rows) raises SampleFileError naming the file and line: a half-read
file would silently bias a regressor. Individual bad *values* (non-finite or non-positive
durations, impossible shapes) are dropped and reported per file instead.

Sample rows are converted here from the benchmark's (mp, b, l, h, dim) to the generic
per-rank shapes of neox_perf.prediction.opspec, so the regressors never see a paper-specific multiple.
"""
from __future__ import annotations

import csv
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.profile.directory import sha256_of

from ..errors import SampleFileError

US = 1e-6  # sample durations are microseconds; everything downstream is seconds
COLLECTIVE_PHASE = "comm"  # collectives have no fwd/bwd; one phase name keeps tables uniform

_F, _B, _DUR = "F_dur(us)", "B_dur(us)", "dur(us)"
_GEMM_COLS = ("mp", "b", "l", "dim", _F, _B)
_NORM_COLS = ("b", "l", "dim", _F, _B)
_HEAD_COLS = ("mp", "b", "h", "l", "dim", _F, _B)
_SOFTMAX_COLS = ("mp", "b", "h", "l", _F, _B)
_CE_COLS = ("mp", "b", "l", _F, _B)
_OPT_COLS = ("mp", "dim", "encoders", _DUR)
NCCL_COLS = ("shape", "nodes", "GPUsPerNode", _DUR)


def _vocab(mp):
    return np.array([opspec.vocab_per_rank(opspec.DEFAULT_VOCAB, int(m)) for m in mp], dtype=float)


def _gemm(k, n):
    return lambda c: {"m": c["b"] * c["l"], "k": k(c), "n": n(c)}


def _stage(stage):
    def convert(c):
        params = [opspec.neox_stage_params(int(d), int(e), int(m), stage)
                  for m, d, e in zip(c["mp"], c["dim"], c["encoders"])]
        return {"params": np.array(params, dtype=float)}
    return convert


@dataclass(frozen=True)
class SourceOp:
    op: str
    columns: Tuple[str, ...]
    convert: Callable[[Dict[str, np.ndarray]], Dict[str, np.ndarray]]
    stage: Optional[str] = None


# sample-file operator name -> canonical operator, expected columns, row -> features
SOURCE_OPS: Dict[str, SourceOp] = {
    "linear1": SourceOp("linear1", _GEMM_COLS, _gemm(lambda c: c["dim"], lambda c: 3 * c["dim"] / c["mp"])),
    "linear2": SourceOp("linear2", _GEMM_COLS, _gemm(lambda c: c["dim"] / c["mp"], lambda c: c["dim"])),
    "linear3": SourceOp("linear3", _GEMM_COLS, _gemm(lambda c: c["dim"], lambda c: 4 * c["dim"] / c["mp"])),
    "linear4": SourceOp("linear4", _GEMM_COLS, _gemm(lambda c: 4 * c["dim"] / c["mp"], lambda c: c["dim"])),
    "linear_final": SourceOp("linear_final", _GEMM_COLS, _gemm(lambda c: c["dim"], lambda c: _vocab(c["mp"]))),
    "embedding": SourceOp("embedding", _GEMM_COLS,
                          lambda c: {"tokens": c["b"] * c["l"], "vocab": _vocab(c["mp"]), "d": c["dim"]}),
    "gelu": SourceOp("gelu", _GEMM_COLS, lambda c: {"tokens": c["b"] * c["l"], "width": 4 * c["dim"] / c["mp"]}),
    "layernorm": SourceOp("layernorm", _NORM_COLS, lambda c: {"tokens": c["b"] * c["l"], "d": c["dim"]}),
    "RMSlayernorm": SourceOp("rmsnorm", _NORM_COLS, lambda c: {"tokens": c["b"] * c["l"], "d": c["dim"]}),
    "res_add": SourceOp("res_add", _NORM_COLS, lambda c: {"tokens": c["b"] * c["l"], "d": c["dim"]}),
    "RoPE": SourceOp("rope", _HEAD_COLS, lambda c: {"tokens": c["b"] * c["l"], "heads": c["h"] / c["mp"],
                                                    "rot_dim": c["dim"] / c["h"]}),
    "baddbmm": SourceOp("qk", _HEAD_COLS, lambda c: {"batch": c["b"] * c["h"] / c["mp"], "l": c["l"],
                                                     "head_dim": c["dim"] / c["h"]}),
    "bmm": SourceOp("av", _HEAD_COLS, lambda c: {"batch": c["b"] * c["h"] / c["mp"], "l": c["l"],
                                                 "head_dim": c["dim"] / c["h"]}),
    "fillmask": SourceOp("fillmask", _HEAD_COLS, lambda c: {"batch": c["b"] * c["h"] / c["mp"], "l": c["l"]}),
    "softmax": SourceOp("softmax", _SOFTMAX_COLS, lambda c: {"batch": c["b"] * c["h"] / c["mp"], "l": c["l"]}),
    "ScaledUpperTriangMaskedSoftmax": SourceOp(
        "fused_softmax", _SOFTMAX_COLS, lambda c: {"batch": c["b"] * c["h"] / c["mp"], "l": c["l"]}),
    "flash_atten": SourceOp("flash_attention", _HEAD_COLS, lambda c: {
        "b": c["b"], "l": c["l"], "heads": c["h"] / c["mp"], "head_dim": c["dim"] / c["h"],
        "causal": np.zeros_like(c["b"])}),  # sampled non-causal
    "parallel_cross_entropy_128": SourceOp("cross_entropy", _CE_COLS,
                                           lambda c: {"tokens": c["b"] * c["l"], "vocab": _vocab(c["mp"])}),
    "firstStage_optimizer": SourceOp("optimizer", _OPT_COLS, _stage("first"), "first"),
    "middleStage_optimizer": SourceOp("optimizer", _OPT_COLS, _stage("middle"), "middle"),
    "lastStage_optimizer": SourceOp("optimizer", _OPT_COLS, _stage("last"), "last"),
}

# sample-file collective name -> canonical collective
SOURCE_COLLECTIVES = {"allreduce": "allreduce", "allreduce_large": "allreduce",
                      "allgather_large": "allgather", "p2p": "p2p"}

# Files deliberately not used, with the reason recorded in the manifest.
KNOWN_UNUSED = {
    "optimizer": "schema (num_layers, hidden_size, param_tensors, params, dur) is not described "
                 "by the data README and its per-parameter cost disagrees with the stage "
                 "optimizer files; the stage files are used instead",
}


def read_csv(path: Path, expected: Tuple[str, ...]) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
    """Columns by name and the 1-based line number of every data row.

    Numbers that parse but are not finite (nan, inf) are kept here; the cleaning step
    drops and counts them. Anything that does not parse is a corrupt file.
    """
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except UnicodeDecodeError as exc:
        raise SampleFileError(path, f"not a text CSV ({exc.reason})") from None
    except OSError as exc:
        raise SampleFileError(path, f"cannot read: {exc.strerror}") from None
    rows = [(i + 1, r) for i, r in enumerate(rows) if any(cell.strip() for cell in r)]
    if not rows:
        raise SampleFileError(path, "empty file (no header, no rows)")
    header_line, header = rows[0]
    header = tuple(h.strip() for h in header)
    if sorted(header) != sorted(expected) or len(set(header)) != len(header):
        raise SampleFileError(path, f"unexpected header {','.join(header)}; expected columns "
                                    f"{','.join(expected)}", header_line)
    if len(rows) == 1:
        raise SampleFileError(path, "header only, no data rows", header_line)
    values = np.empty((len(rows) - 1, len(header)), dtype=float)
    lines = np.empty(len(rows) - 1, dtype=np.int64)
    for i, (line, row) in enumerate(rows[1:]):
        if len(row) != len(header):
            raise SampleFileError(path, f"{len(row)} fields, the header has {len(header)}", line)
        for j, cell in enumerate(row):
            try:
                values[i, j] = float(cell)
            except ValueError:
                raise SampleFileError(path, f"column {header[j]!r}: {cell.strip()!r} is not a number",
                                      line) from None
        lines[i] = line
    return {name: values[:, j] for j, name in enumerate(header)}, lines


@dataclass
class FileRecord:
    """Provenance and the fate of every row of one sample file."""

    path: Path
    kind: str  # operator | nccl
    source_name: str
    used_for: Optional[str] = None  # canonical op / collective
    skipped: Optional[str] = None  # reason the whole file is not used
    sha256: str = ""
    rows: int = 0
    kept: Dict[str, int] = field(default_factory=dict)  # phase -> rows kept
    dropped: Dict[str, Dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    capped: Dict[str, int] = field(default_factory=dict)  # phase -> rows raised to the achievable rate

    def drop(self, phase: str, reason: str, count: int = 1) -> None:
        if count:
            bucket = self.dropped[phase]
            bucket[reason] = bucket.get(reason, 0) + int(count)

    def to_dict(self) -> dict:
        out = {"file": self.path.name, "kind": self.kind, "sha256": self.sha256, "rows": self.rows}
        if self.skipped:
            out["skipped"] = self.skipped
        else:
            out["used_for"] = self.used_for
            out["kept"] = dict(self.kept)
            out["dropped"] = {p: dict(r) for p, r in self.dropped.items() if r}
            if any(self.capped.values()):
                out["capped_to_achievable"] = {p: n for p, n in self.capped.items() if n}
        return out


@dataclass
class TrainingSet:
    """All rows for one (op or collective, phase), with where each came from."""

    op: str
    phase: str
    features: Dict[str, np.ndarray]
    seconds: np.ndarray
    file_index: np.ndarray  # index into the list of FileRecords
    line: np.ndarray  # 1-based line in that file
    raw: Dict[str, np.ndarray] = field(default_factory=dict)  # the sample's own columns (mp, b, l, ...)
    # the kernel whose blocks a causal sample's work follows (opspec.causal_work_fraction):
    # None for the default (FlashAttention-2 on a GPU), opspec.TORCH_CPU for a CPU calibration
    causal_kernel: Optional[str] = None

    def __len__(self) -> int:
        return len(self.seconds)

    def subset(self, mask: np.ndarray) -> "TrainingSet":
        return TrainingSet(self.op, self.phase, {k: v[mask] for k, v in self.features.items()},
                           self.seconds[mask], self.file_index[mask], self.line[mask],
                           {k: v[mask] for k, v in self.raw.items()}, self.causal_kernel)


_OP_FILE = re.compile(r"^(?P<gpu>[^_]+)_(?P<op>.+)_fp16\.csv$")
_NCCL_FILE = re.compile(r"^(?P<gpu>[^_]+)_(?P<coll>.+?)_fp16(?:_(?P<nodes>\d+)_(?P<gpn>\d+))?\.csv$")


def _append(sets, key, feats, seconds, file_idx, lines, cols):
    raw = {k: v for k, v in cols.items() if not k.endswith("(us)")}
    sets[key].append((feats, seconds, np.full(len(seconds), file_idx), lines, raw))


def load_cluster(cluster_dir: Path) -> Tuple[Dict[Tuple[str, str], TrainingSet], List[FileRecord]]:
    """Read every sample file of one cluster (its operator/ and nccl/ folders).

    Returns training sets keyed by (op, phase) -- collectives use phase "comm" -- and one
    FileRecord per CSV found (used or skipped, with the reason).
    """
    cluster_dir = Path(cluster_dir)
    if not (cluster_dir / "operator").is_dir() or not (cluster_dir / "nccl").is_dir():
        raise SampleFileError(cluster_dir, "not a samples folder: expected operator/ and nccl/ inside")
    records: List[FileRecord] = []
    parts = defaultdict(list)
    for path in sorted((cluster_dir / "operator").glob("*.csv")):
        _read_operator_file(path, records, parts)
    union_files = []
    for path in sorted((cluster_dir / "nccl").glob("*.csv")):
        union = _read_nccl_file(path, records, parts)
        if union is not None:
            union_files.append(union)
    for record, cols in union_files:
        _check_union(record, cols, records)
    sets = {}
    for key, chunks in parts.items():
        feats = {name: np.concatenate([c[0][name] for c in chunks]) for name in chunks[0][0]}
        raw_names = set.intersection(*(set(c[4]) for c in chunks))
        raw = {name: np.concatenate([c[4][name] for c in chunks]) for name in sorted(raw_names)}
        sets[key] = TrainingSet(key[0], key[1], feats, np.concatenate([c[1] for c in chunks]),
                                np.concatenate([c[2] for c in chunks]), np.concatenate([c[3] for c in chunks]), raw)
    return sets, records


def _read_operator_file(path, records, parts):
    match = _OP_FILE.match(path.name)
    record = FileRecord(path, "operator", match.group("op") if match else path.stem, sha256=sha256_of(path))
    records.append(record)
    if not match:
        record.skipped = "regressor summary of the paper's authors, not samples"
        return
    source = SOURCE_OPS.get(record.source_name)
    if source is None:
        record.skipped = KNOWN_UNUSED.get(record.source_name, "operator not in the neox-perf vocabulary")
        return
    cols, lines = read_csv(path, source.columns)
    record.rows = len(lines)
    record.used_for = source.op
    # rows with invalid shapes get nan features (durations pass through as read); cleaning
    # drops and counts both. Converters run on placeholder 1s so they never see a nan.
    bad_input = np.zeros(len(lines), dtype=bool)
    for name in cols:
        if not name.endswith("(us)"):
            bad_input |= ~np.isfinite(cols[name]) | (cols[name] <= 0)
    safe = {k: (v if k.endswith("(us)") else np.where(bad_input, 1.0, v)) for k, v in cols.items()}
    feats = {k: np.where(bad_input, np.nan, v) for k, v in source.convert(safe).items()}
    phases = ((opspec.OPTIMIZER_PHASE, _DUR),) if source.stage else (("fwd", _F), ("bwd", _B))
    for phase, column in phases:
        _append(parts, (source.op, phase), feats, cols[column] * US, len(records) - 1, lines, cols)


def _read_nccl_file(path, records, parts):
    match = _NCCL_FILE.match(path.name)
    record = FileRecord(path, "nccl", match.group("coll") if match else path.stem, sha256=sha256_of(path))
    records.append(record)
    if not match:
        record.skipped = "regressor summary of the paper's authors, not samples"
        return None
    kind = SOURCE_COLLECTIVES.get(record.source_name)
    if kind is None:
        record.skipped = "collective not in the neox-perf vocabulary"
        return None
    cols, lines = read_csv(path, NCCL_COLS)
    record.rows = len(lines)
    record.used_for = kind
    if match.group("nodes") is None:
        return record, cols  # checked against the per-topology files once all are read
    nodes, gpn = int(match.group("nodes")), int(match.group("gpn"))
    wrong = (cols["nodes"] != nodes) | (cols["GPUsPerNode"] != gpn)
    if np.any(wrong):
        line = int(lines[np.argmax(wrong)])
        raise SampleFileError(path, f"row says nodes={cols['nodes'][wrong][0]:g}, GPUsPerNode="
                                    f"{cols['GPUsPerNode'][wrong][0]:g} but the file name says "
                                    f"{nodes}_{gpn}", line)
    feats = {"elements": cols["shape"], "nodes": cols["nodes"], "gpus_per_node": cols["GPUsPerNode"]}
    _append(parts, (kind, COLLECTIVE_PHASE), feats, cols[_DUR] * US, len(records) - 1, lines, cols)
    return None


def _check_union(record, cols, records):
    """Files without a topology suffix are documented unions of the per-topology files.

    They are not trained on (that would double-count rows); they are checked to really be
    the union so a mismatch is reported rather than silently ignored.
    """
    per_topology = [r for r in records if r.kind == "nccl" and r.source_name == record.source_name
                    and r is not record and r.skipped is None and r.rows]
    union = {tuple(row) for row in np.column_stack([cols[c] for c in NCCL_COLS]).tolist()}
    parts_rows = set()
    for r in per_topology:
        c, _ = read_csv(r.path, NCCL_COLS)
        parts_rows |= {tuple(row) for row in np.column_stack([c[k] for k in NCCL_COLS]).tolist()}
    if union == parts_rows:
        record.skipped = "union of the per-topology files (identical rows); not double-counted"
    else:
        record.skipped = (f"claims to be the union of the per-topology files but differs "
                          f"({len(union - parts_rows)} rows only here, {len(parts_rows - union)} "
                          f"missing); not used")

