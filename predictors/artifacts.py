"""A profile's trees: the arrays file, and one model's view of its manifest entry and trees.

Only numpy and the standard library: loaded on the fast `check` path.
"""
from __future__ import annotations

import hashlib
import io
import re
import struct
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from neox_perf.profile.models import ModelEntry
from neox_perf.profile.sections import RETRAIN
from neox_perf.profile.values import Coverage

from .errors import ProfileError
from .forest import Forest, log_features

ARRAY_KEYS = ("feature", "threshold", "right", "value", "roots")  # per forest: "m<i>.<key>"


def _on(v: float, grid) -> bool:
    return v in grid or any(abs(v - g) <= 1e-9 * max(abs(g), 1.0) for g in grid)


class Model:
    """One op/phase (or collective): baseline coefficients, sampled ranges, lazily read trees."""

    def __init__(self, key: str, entry: ModelEntry, arrays: Optional["Arrays"]):
        self.key = key
        self.derived_from: Optional[str] = None
        self.derived_scale: Optional[str] = None
        self.derived_reason = ""
        self.topologies: Optional[Dict[Tuple[int, int], Tuple[float, float]]] = None
        self._forest: Optional[Forest] = None
        self._forest_entry = None
        self._arrays = arrays
        if entry.derived is not None:
            d = entry.derived
            self.derived_from, self.derived_scale, self.derived_reason = d.from_phase, d.scale, d.reason
            return
        self.features: Tuple[str, ...] = entry.features
        self.lo = [entry.ranges[n][0] for n in self.features]
        self.hi = [entry.ranges[n][1] for n in self.features]
        self.grid = {n: frozenset(vs) for n, vs in (entry.grid or {}).items()}
        self.coef = np.asarray(entry.baseline.coef, dtype=float)
        self.causal_kernel: Optional[str] = entry.baseline.causal_kernel
        self.coef_list = [float(c) for c in self.coef]
        self.tree_columns: Tuple[int, ...] = tuple(self.features.index(n) for n in entry.tree_features)
        if entry.forest is not None:
            self._forest_entry = entry.forest
            if arrays is None or not arrays.has(entry.forest.arrays):
                raise ValueError(f"{key}: trees {entry.forest.arrays!r} missing from the arrays file")
        if entry.topologies is not None:
            self.topologies = {(t.nodes, t.gpus_per_node): t.elements for t in entry.topologies.values()}

    @property
    def forest(self) -> Optional[Forest]:
        if self._forest is None and self._forest_entry is not None:
            f = self._forest_entry
            forest = Forest(*self._arrays.get(f.arrays), f.depth, f.combine, f.base)
            n = forest.n_nodes
            if (n != f.nodes or len(forest.roots) != f.trees or not n
                    or forest.right.min() < 0 or forest.right.max() >= n
                    or forest.roots.min() < 0 or forest.roots.max() >= n
                    or forest.feature.min() < 0 or forest.feature.max() >= len(self.tree_columns)):
                raise ProfileError(self._arrays.path, f"trees of {self.key} do not match the manifest", RETRAIN)
            self._forest = forest
        return self._forest

    def residual(self, columns: List[np.ndarray]) -> np.ndarray:
        forest = self.forest
        if forest is None:
            return np.zeros(len(columns[0]))
        return forest.predict(log_features([columns[j] for j in self.tree_columns]))

    def residual_one(self, values: Tuple[float, ...]) -> float:
        forest = self.forest
        if forest is None:
            return 0.0
        row = log_features([[values[j]] for j in self.tree_columns])[0]
        return forest.predict_one(row)

    def out_of_range_one(self, values: Tuple[float, ...]) -> str:
        parts = []
        for name, v, lo, hi in zip(self.features, values, self.lo, self.hi):
            tol = 1e-9 * max(abs(lo), abs(hi), 1.0)
            if lo - tol <= v <= hi + tol:
                continue
            if lo == hi:
                parts.append(f"{name}={v:g} never sampled (every sample has {name}={lo:g})")
            else:
                side = "below the sampled minimum" if v < lo else "above the sampled maximum"
                parts.append(f"{name}={v:g} {side} {lo if v < lo else hi:g}")
        return f"{self.key}: " + "; ".join(parts) if parts else ""

    def coverage_one(self, values: Tuple[float, ...]) -> Coverage:
        """Where a query lies against this model's samples, and how far outside them."""
        factor, worst = 1.0, ""
        for name, v, lo, hi in zip(self.features, values, self.lo, self.hi):
            tol = 1e-9 * max(abs(lo), abs(hi), 1.0)
            if lo - tol <= v <= hi + tol:
                continue
            edge = lo if v < lo else hi
            # a ratio where both are sizes; a flag (causal 0/1) is off by its distance
            f = (max(v, edge) / min(v, edge) if v > 0 and edge > 0
                 else 1.0 + abs(v - edge) / max(abs(edge), 1.0))
            if f > factor or not worst:
                factor = f
                side = "minimum" if v < lo else "maximum"
                worst = f"{name}={v:g} vs the sampled {side} {edge:g}"
        if worst:
            return Coverage("extrapolated", factor, worst)
        if self.grid and all(n in self.grid and _on(v, self.grid[n])
                             for n, v in zip(self.features, values)):
            return Coverage("sampled", 1.0, "")
        return Coverage("interpolated" if self.grid else "in range", 1.0, "")

    def out_of_range(self, columns: List[np.ndarray]) -> List[str]:
        """Per query: '' or why it lies outside the sampled range of some feature."""
        n = len(columns[0])
        bad = np.zeros(n, dtype=bool)
        for j in range(len(self.features)):
            tol = 1e-9 * max(abs(self.lo[j]), abs(self.hi[j]), 1.0)
            bad |= (columns[j] < self.lo[j] - tol) | (columns[j] > self.hi[j] + tol)
        reasons = [""] * n
        for i in np.flatnonzero(bad):
            reasons[i] = self.out_of_range_one(tuple(float(c[i]) for c in columns))
        return reasons


class Arrays:
    """The profile's arrays file, checked against the manifest's sha256, members read on demand.

    A member the zip stores uncompressed (profiles written since savez stopped deflating) is a
    read-only view into the file's bytes, its .npy header parsed here: `check` reads some 150
    members on every start, and numpy's reader (a zip stream and a literal_eval per member)
    cost it tens of milliseconds. Deflated members, and anything this reader does not accept,
    go through numpy's own loader."""

    def __init__(self, path: Path, expected_sha256: Optional[str]):
        self.path = path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProfileError(path, f"cannot read profile arrays ({exc.strerror})", RETRAIN) from None
        if expected_sha256 and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise ProfileError(path, "profile arrays do not match the manifest's sha256 (corrupt or replaced)",
                               RETRAIN)
        self._data = data
        try:
            self._npz = np.load(io.BytesIO(data), allow_pickle=False)
            self._names = set(self._npz.files)
            self._infos = {i.filename[:-4]: i for i in self._npz.zip.infolist()
                           if i.filename.endswith(".npy")}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise ProfileError(path, f"corrupt profile arrays ({' '.join(str(exc).split())})", RETRAIN) from None

    def has(self, prefix: str) -> bool:
        return all(f"{prefix}.{k}" in self._names for k in ARRAY_KEYS)

    def get(self, prefix: str) -> List[np.ndarray]:
        try:
            return [self._member(f"{prefix}.{k}") for k in ARRAY_KEYS]
        except (KeyError, OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise ProfileError(self.path, f"corrupt profile arrays ({' '.join(str(exc).split())})",
                               RETRAIN) from None

    def _member(self, name: str) -> np.ndarray:
        info = self._infos.get(name)
        view = _stored_npy(self._data, info) if info is not None else None
        return view if view is not None else self._npz[name]


_NPY_HEADER = re.compile(r"""\{'descr': '([<>|][a-z]\d+)', 'fortran_order': False, 'shape': \(((?:\d+, ?)*\d*)\), \}""")


def _stored_npy(data: bytes, info: zipfile.ZipInfo) -> Optional[np.ndarray]:
    """The array of an uncompressed .npy member as a view of `data`, or None when it is not one
    this reader takes (deflated, another header form, a non-numeric dtype)."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    at = info.header_offset
    if data[at:at + 4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
    start = at + 30 + name_len + extra_len
    if data[start:start + 6] != b"\x93NUMPY" or data[start + 6] != 1:
        return None
    (header_len,) = struct.unpack_from("<H", data, start + 8)
    header = data[start + 10:start + 10 + header_len].decode("latin1").strip()
    m = _NPY_HEADER.fullmatch(header)
    if m is None:
        return None
    dtype = np.dtype(m.group(1))
    if dtype.kind not in "iuf":
        return None
    shape = tuple(int(x) for x in m.group(2).replace(" ", "").split(",") if x)
    count = int(np.prod(shape)) if shape else 1
    offset = start + 10 + header_len
    if offset + count * dtype.itemsize > at + 30 + name_len + extra_len + info.file_size:
        return None
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
