"""Train the bundled cluster profiles from the published samples.

    python -m neox_perf.predictors.fitting.train --samples DIR --out neox_perf/profiles

DIR holds Perlmutter/ and Vista/ (default: ../shared/data/paper-2509.22832-samples next to
the repository). For each cluster: read and clean the samples (cleaning.py), fit a baseline
and trees per op/phase and per collective (fit.py), export the trees to arrays (export.py)
and write <out>/<cluster>/manifest.json + arrays.npz. Prints the validation table.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.profile import directory as profile_dir
from neox_perf.profile.manifest import SCHEMA, SCHEMA_VERSION, Manifest
from neox_perf.profile.sections import ArraysRef

from .. import baseline
from ..artifacts import ARRAY_KEYS
from ..errors import SampleFileError
from ..forest import Forest
from . import cleaning, fit
from .known_clusters import KNOWN_CLUSTERS, KnownCluster
from .samples import COLLECTIVE_PHASE, load_cluster

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SAMPLES = REPO.parent / "shared" / "data" / "paper-2509.22832-samples"
DEFAULT_OUT = REPO / "neox_perf" / "profiles"
COLLECTIVE_FEATURES = ("elements", "nodes", "gpus_per_node")
SOURCE = "arXiv 2509.22832 published samples (operator and NCCL timings)"


def _versions() -> Dict[str, str]:
    import sklearn
    import xgboost
    return {"python": platform.python_version(), "numpy": np.__version__,
            "scikit-learn": sklearn.__version__, "xgboost": xgboost.__version__}


def _ranges(features: Dict[str, np.ndarray], names) -> Dict[str, List[float]]:
    return {n: [float(np.min(features[n])), float(np.max(features[n]))] for n in names}


GRID_MAX = 48  # a feature with more distinct sampled values is not a grid: no "sampled" verdict


def _grid(features: Dict[str, np.ndarray], names) -> Dict[str, List[float]]:
    """The distinct sampled values of each feature that was sampled on a grid, so a query can
    be told apart as sampled (every feature at a sampled value) or between samples."""
    out = {}
    for n in names:
        values = np.unique(np.asarray(features[n], dtype=float))
        if len(values) <= GRID_MAX:
            out[n] = [float(v) for v in values]
    return out


class _ArrayPool:
    """Every exported forest of a profile, one group of members ("m<i>.feature", ...) each,
    so a profile can decompress only the models it actually uses."""

    def __init__(self):
        self.members: Dict[str, np.ndarray] = {}
        self.models = 0
        self.nodes = 0
        self.trees = 0

    def add(self, forest: Forest) -> dict:
        prefix = f"m{self.models}"
        for name in ARRAY_KEYS:
            self.members[f"{prefix}.{name}"] = getattr(forest, name)
        self.models += 1
        self.nodes += forest.n_nodes
        self.trees += len(forest.roots)
        return {"arrays": prefix, "nodes": forest.n_nodes, "trees": int(len(forest.roots)),
                "depth": int(forest.depth), "combine": forest.combine, "base": float(forest.base)}


def _model_entry(result: fit.FitResult, names, pool: _ArrayPool) -> dict:
    entry = {
        "tree_features": [names[j] for j in result.tree_columns],
        "model": result.chosen,
        "hyperparameters": result.hyperparameters,
        "validation_mape": {k: (None if not np.isfinite(v) else float(v)) for k, v in result.validation.items()},
        "validation_best_kind": result.validation_detail,
    }
    if result.forest is not None:
        entry["forest"] = pool.add(result.forest)
        entry["export_max_error"] = result.export_error
    return entry


def _at_limit(terms, coef, lower) -> List[str]:
    return [t for t, c, lo in zip(terms, coef, lower) if lo > 0 and c <= lo * (1 + 1e-9)]


def _roofline_entry(coef: np.ndarray, lower) -> dict:
    t0, spf, spb = (float(c) for c in coef)
    return {"form": "t0 + flops*sec_per_flop + bytes*sec_per_byte", "terms": list(baseline.ROOFLINE_TERMS),
            "coef": [t0, spf, spb], "lower_bounds": [float(v) for v in lower],
            "at_lower_bound": _at_limit(baseline.ROOFLINE_TERMS, coef, lower),
            "achieved_tflops": (1.0 / spf / 1e12) if spf > 0 else None,
            "achieved_gbps": (1.0 / spb / 1e9) if spb > 0 else None}


def _collective_entry(coef: np.ndarray, lower, lanes: int) -> dict:
    c = dict(zip(baseline.COLLECTIVE_TERMS, (float(v) for v in coef)))
    return {"form": "alpha + ring_wire_bytes/bandwidth, alpha and bandwidth per topology class "
                    "(intra-node: g-1 peer links; inter-node: min(g, lanes) NICs)",
            "terms": list(baseline.COLLECTIVE_TERMS), "coef": [float(v) for v in coef], "nic_lanes": lanes,
            "lower_bounds": [float(v) for v in lower],
            "at_lower_bound": _at_limit(baseline.COLLECTIVE_TERMS, coef, lower),
            "intra_peer_link_gbps": (1e-9 / c["sec_per_byte_intra"]) if c["sec_per_byte_intra"] > 0 else None,
            "inter_per_nic_gbps": (1e-9 / c["sec_per_byte_inter"]) if c["sec_per_byte_inter"] > 0 else None}


def _link_notes(kind: str, base: dict, facts, topologies: dict) -> List[str]:
    """What the fitted bandwidths say against the data sheet (measured, reported, not corrected)."""
    out = []
    intra = any(t["nodes"] == 1 for t in topologies.values())
    inter = any(t["nodes"] > 1 for t in topologies.values())
    if intra and base["intra_peer_link_gbps"]:
        peers = max(facts.gpus_per_node - 1, 1)
        nominal = facts.intra_node_link.bandwidth_gbps / peers
        out.append(f"{kind}: fitted intra-node bandwidth {base['intra_peer_link_gbps']:.3g} GB/s per peer "
                   f"link, {base['intra_peer_link_gbps'] / nominal:.0%} of the nominal {nominal:.3g} GB/s "
                   f"({facts.intra_node_link.name} shared by {peers} peers)")
    if inter and base["inter_per_nic_gbps"]:
        nominal = facts.inter_node_link.bandwidth_gbps / facts.inter_node_link.lanes
        out.append(f"{kind}: fitted inter-node bandwidth {base['inter_per_nic_gbps']:.3g} GB/s per NIC, "
                   f"{base['inter_per_nic_gbps'] / nominal:.0%} of the nominal {nominal:.3g} GB/s "
                   f"({facts.inter_node_link.name}); as measured, not corrected")
    if not intra:
        out.append(f"{kind}: no intra-node samples; intra-node coefficients are unfitted limits")
    return out


def write_profile(out_dir: Path, manifest: dict, members: Dict[str, np.ndarray]) -> Manifest:
    """The manifest as the trainer built it, read back as the loader will read it, and its
    trees, written as a new version of the profile at ``out_dir`` by the one writer
    (neox_perf/profile/directory.py: swapped in whole). Returns the manifest as written."""
    typed = Manifest.parse(manifest, f"{out_dir} (new manifest)")
    with profile_dir.replacing(out_dir) as tmp:
        return profile_dir.write(tmp, typed, arrays=members)


def fit_set(key: str, op: str, phase: str, ts, facts, grid, pool: "_ArrayPool",
            operators: Dict[str, Dict[str, dict]], collectives: Dict[str, dict],
            notes: List[str], blended: bool = False) -> fit.FitResult:
    """Fit one (op, phase) sample set and file its manifest entry under ``operators`` or
    ``collectives``: shared by the bundled profiles' trainer and `neox-perf calibrate`."""
    names = COLLECTIVE_FEATURES if phase == COLLECTIVE_PHASE else opspec.op_spec(op).features
    limits = cleaning.baseline_limits(ts, facts)
    result = fit.fit_one(key, cleaning.baseline_design(ts, facts), [ts.features[n] for n in names],
                         ts.seconds, grid=grid, limits=limits, blended=blended)
    entry = {"features": list(names), "rows": int(len(ts)), "ranges": _ranges(ts.features, names),
             "grid": _grid(ts.features, names)}
    entry.update(_model_entry(result, list(names), pool))
    if phase == COLLECTIVE_PHASE:
        entry["baseline"] = _collective_entry(result.coef, limits[0], facts.inter_node_link.lanes)
        topo = {}
        for nodes, gpn in sorted({(int(a), int(b)) for a, b in zip(ts.features["nodes"],
                                                                   ts.features["gpus_per_node"])}):
            m = (ts.features["nodes"] == nodes) & (ts.features["gpus_per_node"] == gpn)
            el = ts.features["elements"][m]
            topo[f"{nodes}x{gpn}"] = {"nodes": nodes, "gpus_per_node": gpn, "rows": int(m.sum()),
                                      "elements": [float(el.min()), float(el.max())]}
        entry["topologies"] = topo
        collectives[op] = entry
        notes.extend(_link_notes(op, entry["baseline"], facts, topo))
    else:
        entry["baseline"] = _roofline_entry(result.coef, limits[0])
        if ts.causal_kernel is not None and "causal" in names:
            entry["baseline"]["causal_kernel"] = ts.causal_kernel
        operators.setdefault(op, {})[phase] = entry
    return result


def train_cluster(samples_root: Path, known: KnownCluster, out_root: Path, grid=None,
                  log=print) -> Tuple[dict, List[tuple]]:
    facts = known.facts
    started = time.perf_counter()
    sets, records = load_cluster(Path(samples_root) / known.sample_dir)
    cleaned = cleaning.clean(sets, records, facts)
    pool = _ArrayPool()
    operators: Dict[str, Dict[str, dict]] = {}
    collectives: Dict[str, dict] = {}
    table: List[tuple] = []
    notes: List[str] = []
    for (op, phase), derived in sorted(cleaned.derived.items()):
        operators.setdefault(op, {})[phase] = {"derived": derived.to_dict()}
        table.append((op, phase, 0, None, derived))
    for (op, phase), ts in sorted(cleaned.sets.items()):
        key = f"{known.facts.name}/{op}/{phase}"
        result = fit_set(key, op, phase, ts, facts, grid, pool, operators, collectives, notes)
        table.append((op, phase, len(ts), result, None))
        log(f"  {known.facts.name:16s} {op:16s} {phase:5s} rows={len(ts):5d} -> {result.chosen}")

    manifest = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "name": facts.name,
        "facts": facts.to_dict(),
        "notes": list(known.notes) + cleaned.notes + notes,
        "provenance": {
            "source": SOURCE, "license": "MIT",
            "license_files": sorted(p.name for p in Path(samples_root).glob("LICENSE*")),
            "sample_dir": known.sample_dir,
            "device_string": known.device_string,
            "files": [r.to_dict() for r in records],
        },
        "training": {
            "library_versions": _versions(),
            "validation": "one seeded 80/20 split per op/phase; MAPE on seconds; chosen model refitted on all rows",
            "tree_input": "natural log of each varying feature, cast to float32; target log(seconds / baseline)",
            "grid": [[k, p] for k, p in (grid if grid is not None else fit.candidates())],
            "cleaning": {"flop_slack": cleaning.FLOP_SLACK, "byte_slack": cleaning.BYTE_SLACK,
                         "link_slack": cleaning.LINK_SLACK, "mad_k": cleaning.MAD_K,
                         "min_outlier_ratio": float(np.exp(cleaning.MIN_OUTLIER_LOG)),
                         "gross_outlier_ratio": float(np.exp(cleaning.GROSS_OUTLIER_LOG)),
                         "neighbours": cleaning.NEIGHBOURS},
            "flash_attention_causal": (
                f"samples are non-causal; a causal query scales the FLOP term by the share of "
                f"{opspec.CAUSAL_TILE}-row tiles on or below the diagonal, (n+1)/(2n) for n = "
                f"ceil(l/{opspec.CAUSAL_TILE}), reuses the non-causal residual (same kernel "
                f"efficiency assumed) and is flagged extrapolated"),
            "seconds": None,
        },
        "arrays": ArraysRef(models=pool.models, nodes=pool.nodes, trees=pool.trees).to_dict(),
        "operators": operators,
        "collectives": collectives,
    }
    manifest["training"]["seconds"] = round(time.perf_counter() - started, 1)
    written = write_profile(Path(out_root) / facts.name, manifest, pool.members)
    return written.to_dict(), table  # as written to manifest.json


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neox_perf.predictors.fitting.train", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=Path, default=DEFAULT_SAMPLES,
                        help="folder with Perlmutter/ and Vista/ sample folders")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="profiles folder to write into")
    parser.add_argument("--cluster", action="append", choices=sorted(KNOWN_CLUSTERS),
                        help="train only this cluster (repeatable); default all")
    parser.add_argument("--quick", action="store_true", help="tiny tree grid (smoke runs, not for release)")
    args = parser.parse_args(argv)
    if not args.samples.is_dir():
        print(f"train: samples folder {args.samples} not found (fix: pass --samples DIR)", file=sys.stderr)
        return 2
    from neox_perf.render.fit_table import print_fit_table  # the maintainer's table: rich
    grid = fit.QUICK_GRID if args.quick else None
    for name in args.cluster or sorted(KNOWN_CLUSTERS):
        started = time.perf_counter()
        try:
            manifest, table = train_cluster(args.samples, KNOWN_CLUSTERS[name], args.out, grid=grid)
        except SampleFileError as exc:
            print(f"train: {exc}", file=sys.stderr)
            return 1
        print_fit_table(name, sorted(table, key=lambda r: (r[1] == COLLECTIVE_PHASE, r[0], r[1] != "fwd")))
        size = sum(p.stat().st_size for p in (args.out / name).iterdir())
        print(f"{name}: {manifest['arrays']['trees']} trees, {manifest['arrays']['nodes']} nodes, "
              f"{size / 1e6:.2f} MB, trained in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
