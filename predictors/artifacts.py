"""The on-disk form of a profile: constants, the arrays file, and one model's view of it.

Only numpy and the standard library: loaded on the fast `check` path.
"""
from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .errors import ProfileError
from .forest import Forest, log_features

SCHEMA = "neox-perf-profile"
SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
ARRAYS_FILE = "arrays.npz"
ARRAY_KEYS = ("feature", "threshold", "right", "value", "roots")
RETRAIN = "retrain it with `python -m neox_perf.predictors.train`"


class Model:
    """One op/phase (or collective): baseline coefficients, sampled ranges, lazily read trees."""

    def __init__(self, key: str, entry: dict, arrays: Optional["Arrays"]):
        self.key = key
        self.derived_from: Optional[str] = None
        self.derived_scale: Optional[str] = None
        self.derived_reason = ""
        self.topologies: Optional[Dict[Tuple[int, int], Tuple[float, float]]] = None
        self._forest: Optional[Forest] = None
        self._forest_entry = None
        self._arrays = arrays
        if "derived" in entry:
            d = entry["derived"]
            self.derived_from, self.derived_scale, self.derived_reason = d["from_phase"], d["scale"], d["reason"]
            return
        self.features: Tuple[str, ...] = tuple(entry["features"])
        self.lo = [float(entry["ranges"][n][0]) for n in self.features]
        self.hi = [float(entry["ranges"][n][1]) for n in self.features]
        self.coef = np.asarray(entry["baseline"]["coef"], dtype=float)
        self.coef_list = [float(c) for c in self.coef]
        self.tree_columns: Tuple[int, ...] = tuple(self.features.index(n) for n in entry["tree_features"])
        if "forest" in entry:
            self._forest_entry = entry["forest"]
            if arrays is None or not arrays.has(entry["forest"]["arrays"]):
                raise ValueError(f"{key}: trees {entry['forest'].get('arrays')!r} missing from the arrays file")
        if "topologies" in entry:
            self.topologies = {(t["nodes"], t["gpus_per_node"]): tuple(t["elements"])
                               for t in entry["topologies"].values()}

    @property
    def forest(self) -> Optional[Forest]:
        if self._forest is None and self._forest_entry is not None:
            f = self._forest_entry
            forest = Forest(*self._arrays.get(f["arrays"]), int(f["depth"]), f["combine"], float(f["base"]))
            n = forest.n_nodes
            if (n != f["nodes"] or len(forest.roots) != f["trees"] or not n
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
        row = np.log(np.array([values[j] for j in self.tree_columns], dtype=np.float64)).astype(np.float32)
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
    """The profile's arrays file, checked against the manifest's sha256, members read on demand."""

    def __init__(self, path: Path, expected_sha256: Optional[str]):
        self.path = path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProfileError(path, f"cannot read profile arrays ({exc.strerror})", RETRAIN) from None
        if expected_sha256 and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise ProfileError(path, "profile arrays do not match the manifest's sha256 (corrupt or replaced)",
                               RETRAIN)
        try:
            self._npz = np.load(io.BytesIO(data), allow_pickle=False)
            self._names = set(self._npz.files)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise ProfileError(path, f"corrupt profile arrays ({' '.join(str(exc).split())})", RETRAIN) from None

    def has(self, prefix: str) -> bool:
        return all(f"{prefix}.{k}" in self._names for k in ARRAY_KEYS)

    def get(self, prefix: str) -> List[np.ndarray]:
        try:
            return [self._npz[f"{prefix}.{k}"] for k in ARRAY_KEYS]
        except (KeyError, OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise ProfileError(self.path, f"corrupt profile arrays ({' '.join(str(exc).split())})",
                               RETRAIN) from None
