"""How well a sampled profile transferred to another GPU predicts that GPU's own samples.

    python benchmarks/transfer_gpu.py [--samples DIR] [--json]

Leave one GPU out over the published samples: every (cleaned) Vista (GH200) operator sample
is predicted by the perlmutter-a100-80gb profile transferred to GH200-96GB, and every
Perlmutter (A100-SXM4-80GB) sample by vista-gh200 transferred to A100-SXM4-80GB. Nothing is
fitted on the target's samples: the transfer uses the base profile and the two GPU rows only
(their achievable fp16 rates and HBM bandwidths, gpus.transfer_rates). The target's samples
are compared as measured: cleaned of defects, not raised to the achievable rate (that rule of
cleaning.py is for training; here they are the held-out truth). Prints MAPE per operator and phase for each method of predictors/transfer.py
(plain roofline max-ratio, additive roofline ratio, additive ratio with the base's fitted
fixed cost kept), the median over operators and the MAPE over all samples.

Collectives are reported separately: the target's NCCL samples predicted from the base's,
scaled by the link model of the target's links at the base's fitted efficiencies (`base
eff.`) and at the reference efficiencies the descriptions use by default (`reference eff.`).
The reference efficiencies were fitted on these very samples (NDR InfiniBand on Vista, NVLink
3.0 on Perlmutter): every figure that used the target's own efficiency is marked `*` and is
not a held-out result.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neox_perf.prediction import opspec  # noqa: E402
from neox_perf.predictors.fitting import cleaning  # noqa: E402
from neox_perf.predictors import cluster_file, gpus, transfer  # noqa: E402
from neox_perf.predictors.fitting.known_clusters import KNOWN_CLUSTERS  # noqa: E402
from neox_perf.predictors.profile import load_profile  # noqa: E402
from neox_perf.predictors.fitting.samples import COLLECTIVE_PHASE, load_cluster  # noqa: E402

DEFAULT_SAMPLES = REPO.parent / "shared" / "data" / "paper-2509.22832-samples"
DIRECTIONS = (("perlmutter-a100-80gb", "vista-gh200", "Vista", "GH200-96GB"),
              ("vista-gh200", "perlmutter-a100-80gb", "Perlmutter", "A100-SXM4-80GB"))


def _described(base, target_name: str, gpu: str, method: str, inter_eff=None):
    facts = KNOWN_CLUSTERS[target_name].facts
    data = {"name": f"{base.name}-as-{gpu}", "base": base.name, "gpu": gpu,
            "gpus_per_node": facts.gpus_per_node, "inter_node_Gbps": facts.inter_node_link.bandwidth_gbps * 8,
            "nics_per_node": facts.inter_node_link.lanes, "intra_node_topology": "pointtopoint"}
    if facts.gpus_per_node > 1:
        data["intra_node_GBps"] = facts.intra_node_link.bandwidth_gbps
    if inter_eff is not None:
        data["inter_node_efficiency"] = inter_eff
    desc = cluster_file.parse(data, Path(f"<{data['name']}>"))
    return transfer.TransferredProfile(desc, base, transfer.base_gpu_of(desc, base), method=method)


def operator_table(samples: Path):
    rows = []
    for base_name, target_name, folder, gpu in DIRECTIONS:
        base = load_profile(base_name)
        sets, records = load_cluster(samples / folder)
        kept = cleaning.clean(sets, records, KNOWN_CLUSTERS[target_name].facts, precision=None)
        profiles = {m: _described(base, target_name, gpu, m) for m in transfer.METHODS}
        for (op, phase), ts in sorted(kept.sets.items()):
            if phase == COLLECTIVE_PHASE or (op, phase) in kept.derived:
                continue
            try:
                base_seconds = base.predict_many(op, phase, ts.features).seconds
            except Exception:  # the base has no model for it (derived there): not comparable
                continue
            f = np.asarray(opspec.op_flops(op, phase, ts.features), dtype=float)
            b = np.asarray(opspec.op_bytes(op, phase, ts.features), dtype=float)
            row = {"direction": f"{base_name} -> {gpu}", "op": op, "phase": phase, "rows": len(ts),
                   "intensity": float(np.median(f / b)),
                   "measured_over_base": float(np.median(ts.seconds / base_seconds))}
            for m, prof in profiles.items():
                pred = prof.predict_many(op, phase, ts.features).seconds
                err = np.abs(pred / ts.seconds - 1.0)
                row[m] = float(np.mean(err))
                row[f"{m}_abs_sum"] = float(np.sum(err))
            rows.append(row)
    return rows


def collective_table(samples: Path):
    rows = []
    for base_name, target_name, folder, gpu in DIRECTIONS:
        base = load_profile(base_name)
        sets, records = load_cluster(samples / folder)
        kept = cleaning.clean(sets, records, KNOWN_CLUSTERS[target_name].facts, precision=None)
        ref = _described(base, target_name, gpu, transfer.TRANSFER_METHOD)
        for (kind, phase), ts in sorted(kept.sets.items()):
            if phase != COLLECTIVE_PHASE:
                continue
            base_eff = transfer.base_links(base).eff_inter[kind]
            own = _described(base, target_name, gpu, transfer.TRANSFER_METHOD, inter_eff=min(base_eff, 1.0))
            topo = sorted({(int(n), int(g)) for n, g in zip(ts.features["nodes"], ts.features["gpus_per_node"])})
            for nodes, gpn in topo:
                m = (ts.features["nodes"] == nodes) & (ts.features["gpus_per_node"] == gpn)
                el, sec = ts.features["elements"][m], ts.seconds[m]
                out = {"direction": f"{base_name} -> {gpu}", "kind": kind, "topology": f"{nodes}x{gpn}",
                       "rows": int(m.sum())}
                # the reference efficiencies ARE the target's fits: NDR IB from Vista between
                # nodes, NVLink 3.0 from Perlmutter inside one (used whenever a base lacks it)
                leak_inter = target_name == "vista-gh200" and nodes > 1
                leak_intra = target_name == "perlmutter-a100-80gb" and nodes == 1
                out["reference_eff_held_out"] = not (leak_inter or leak_intra)
                out["base_eff_held_out"] = not leak_intra
                for label, prof in (("base_eff", own), ("reference_eff", ref)):
                    pred = np.array([prof.predict_collective(kind, e, nodes, gpn).seconds for e in el])
                    out[label] = float(np.mean(np.abs(pred / sec - 1.0)))
                rows.append(out)
    return rows


def nccl_tests_table(lut_dir: Path):
    """vTrain's nccl-tests all-reduce on one 8-GPU A100 NVSwitch node, predicted by the example
    description dgx-a100.yml (perlmutter samples, 4 GPUs on point-to-point NVLink): the link
    model held out on a topology the samples never had. Sizes are bytes (fp32 in the file),
    asked as the same bytes of fp16 elements. Every row and size band:
    benchmarks/collectives_vtrain.py."""
    import csv
    prof = load_profile(str(REPO / "neox_perf" / "examples" / "clusters" / "dgx-a100.yml"))
    rows = []
    for n in range(2, prof.facts.gpus_per_node + 1):
        path = lut_dir / f"AR_GPU{n}_1M_1024M_LUT"
        if not path.is_file():
            continue
        with open(path, newline="") as fh:
            data = [(float(r["size(B)"]), float(r["time(ns)"]) * 1e-9) for r in csv.DictReader(fh)]
        size = np.array([d[0] for d in data])
        meas = np.array([d[1] for d in data])
        pred = np.array([prof.predict_collective("allreduce", b / 2, 1, n).seconds for b in size])
        big = size >= 32e6
        small = size < 8 * 2 ** 20  # tensor-parallel sizes: latency and the bandwidth ramp
        rows.append({"gpus": n, "rows": len(size), "mape_all": float(np.mean(np.abs(pred / meas - 1))),
                     "mape_below_8MiB": float(np.mean(np.abs(pred[small] / meas[small] - 1))),
                     "mape_32MB_up": float(np.mean(np.abs(pred[big] / meas[big] - 1))),
                     "median_pred_over_measured_32MB_up": float(np.median(pred[big] / meas[big]))})
    return rows


def _summary(rows):
    out = {}
    for direction in sorted({r["direction"] for r in rows}):
        sel = [r for r in rows if r["direction"] == direction]
        n = sum(r["rows"] for r in sel)
        out[direction] = {m: {"median_over_ops": float(np.median([r[m] for r in sel])),
                              "mean_over_ops": float(np.mean([r[m] for r in sel])),
                              "over_samples": sum(r[f"{m}_abs_sum"] for r in sel) / n}
                          for m in transfer.METHODS}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=Path, default=DEFAULT_SAMPLES)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.samples.is_dir():
        print(f"transfer_gpu: samples folder {args.samples} not found (fix: pass --samples DIR)", file=sys.stderr)
        return 2
    ops = operator_table(args.samples)
    colls = collective_table(args.samples)
    summary = _summary(ops)
    nccl = nccl_tests_table(args.samples.parent / "vtrain-a100" / "nccl-allreduce")
    if args.json:
        print(json.dumps({"operators": ops, "collectives": colls, "nccl_tests": nccl, "summary": summary}, indent=1))
        return 0
    methods = transfer.METHODS
    for direction in sorted({r["direction"] for r in ops}):
        print(f"\n{direction}: operator MAPE per op/phase (method chosen: {transfer.TRANSFER_METHOD})")
        print(f"{'op':16s}{'phase':6s}{'rows':>6s}{'F/B':>8s}{'meas/base':>10s}" + "".join(f"{m:>16s}" for m in methods))
        for r in (r for r in ops if r["direction"] == direction):
            print(f"{r['op']:16s}{r['phase']:6s}{r['rows']:6d}{r['intensity']:8.1f}{r['measured_over_base']:10.3f}"
                  + "".join(f"{r[m]:16.1%}" for m in methods))
        for label in ("median_over_ops", "mean_over_ops", "over_samples"):
            print(f"{label:46s}" + "".join(f"{summary[direction][m][label]:16.1%}" for m in methods))
    print("\ncollectives: MAPE per sampled topology of the target")
    print(f"{'direction':40s}{'kind':11s}{'topo':6s}{'rows':>6s}{'base eff.':>12s}{'reference eff.':>16s}")
    for r in colls:
        mark = {k: " " if r[f"{k}_held_out"] else "*" for k in ("base_eff", "reference_eff")}
        print(f"{r['direction']:40s}{r['kind']:11s}{r['topology']:6s}{r['rows']:6d}{r['base_eff']:11.1%}"
              f"{mark['base_eff']}{r['reference_eff']:15.1%}{mark['reference_eff']}")
    print("* not held out: that efficiency was fitted on the target's own samples")
    if nccl:
        print("\nvTrain nccl-tests all-reduce, one 8-GPU A100 NVSwitch node, predicted by dgx-a100.yml")
        print(f"{'GPUs':>5s}{'rows':>6s}{'MAPE':>9s}{'MAPE <8MiB':>12s}{'MAPE >=32MB':>13s}{'pred/meas':>11s}")
        for r in nccl:
            print(f"{r['gpus']:5d}{r['rows']:6d}{r['mape_all']:9.1%}{r['mape_below_8MiB']:12.1%}{r['mape_32MB_up']:13.1%}"
                  f"{r['median_pred_over_measured_32MB_up']:11.3f}")
    print("\nGPU rows:", ", ".join(f"{g.name} {g.achievable('fp16').tflops:g} TFLOP/s achievable fp16 "
                                   f"(data sheet {g.fp16_tflops:g}), {g.hbm_gbps:g} GB/s"
                                   for g in (gpus.gpu("A100-SXM4-80GB"), gpus.gpu("GH200-96GB"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
