"""The calibration store's samples as the trainer's training sets, and the facts this
machine can say about itself, each marked as measured or read:
- device name and memory: the store's device fingerprint; on a CPU the "GPU memory" is the
  total RAM (/proc/meminfo), since a CPU rank allocates from it;
- gpus_per_node: the process count the collectives were launched with;
- peak rate and memory bandwidth: the highest rates the samples themselves reached, not a
  data sheet (nobody publishes an honest peak for one core of a shared VM). The cleaning
  rejects rows faster than these limits times its slack, so with measured limits it rejects
  nothing for being too fast and only the outlier rules apply;
- links: "shared memory (gloo)" on a CPU, at the fastest bus bandwidth measured; nothing
  crosses nodes in a one-node calibration, so the inter-node link is marked unmeasured.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.profile.facts import ClusterFacts, Link

from .samples import COLLECTIVE_PHASE, TrainingSet

GEMMS = ("linear1", "linear2", "linear3", "linear4", "linear_final", "qk", "av")


def total_ram_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _max_rate(sets, ops, quantity) -> float:
    best = 0.0
    for (op, phase), ts in sets.items():
        if op in ops and phase != COLLECTIVE_PHASE and len(ts):
            best = max(best, float(np.max(quantity(op, phase, ts.features) / ts.seconds)))
    return best


def measured_facts(name: str, fingerprint: dict, sets, gpus_per_node: int) -> Tuple[ClusterFacts, List[str]]:
    """Facts for a profile of this machine, and notes saying where each number came from."""
    cpu = fingerprint.get("kind") != "cuda"
    device = str(fingerprint.get("device_name") or "unknown device")
    memory = fingerprint.get("memory_bytes") if not cpu else total_ram_bytes()
    ops = [op for op in opspec.OPERATORS]
    flops = _max_rate(sets, GEMMS, opspec.op_flops) or _max_rate(sets, ops, opspec.op_flops)
    nbytes = _max_rate(sets, ops, opspec.op_bytes)
    wire = 0.0
    for (kind, phase), ts in sets.items():
        if phase == COLLECTIVE_PHASE and len(ts):
            f = ts.features
            bytes_ = opspec.collective_wire_bytes(kind, f["elements"], f["nodes"] * f["gpus_per_node"])
            wire = max(wire, float(np.max(bytes_ / ts.seconds)))
    # fitting divides by these: a store without GEMMs or collectives still needs a positive limit
    flops, nbytes, wire = flops or 1e9, nbytes or 1e9, wire or 1e8
    peers = max(gpus_per_node - 1, 1)
    link_name = "shared memory (gloo)" if cpu else "intra-node (nccl)"
    facts = ClusterFacts(
        name=name,
        gpu_name=f"{device} (CPU)" if cpu else device,
        gpu_memory_bytes=int(memory or 0),
        gpus_per_node=int(gpus_per_node),
        intra_node_link=Link(link_name, wire * peers / 1e9, 1),
        inter_node_link=Link("not measured (one-node calibration)", wire / 1e9, 1),
        peak_fp16_tflops=flops / 1e12,
        hbm_bandwidth_gbps=nbytes / 1e9,
        # whether its fp32 matmuls ran as TF32 (calibration/fingerprint.tf32_state); a CPU has no TF32
        tf32=None if cpu or fingerprint.get("tf32") is None else bool(fingerprint["tf32"]),
    )
    what = "CPU stand-in for a GPU" if cpu else "GPU"
    notes = [
        f"{what}: facts measured on this machine by `neox-perf calibrate`, not from a data sheet",
        f"peak_fp16_tflops is the fastest GEMM rate the samples reached ({flops / 1e9:.3g} GFLOP/s"
        f" at {fingerprint.get('torch_threads', '?')} thread(s)), hbm_bandwidth_gbps the fastest "
        f"byte rate of any operator sample ({nbytes / 1e9:.3g} GB/s, caches included)",
        f"gpus_per_node = {gpus_per_node}: the processes the collectives were launched with",
        f"intra_node_link: fastest measured bus bandwidth {wire / 1e9:.3g} GB/s per peer link; "
        f"the inter-node link was not measured and is set to the same value",
    ]
    if cpu:
        notes.insert(1, "gpu_memory_bytes is the machine's total RAM, which CPU ranks share")
    return facts, notes


def _device_of(store, device: Optional[int]) -> Tuple[int, dict]:
    devices = store.devices()
    if not devices:
        raise ValueError(f"{store.path}: no calibration samples yet; run `neox-perf calibrate` first")
    if device is None:
        counts: Dict[int, int] = {}
        for s in store.samples(source="calibrate"):
            counts[s.device_id] = counts.get(s.device_id, 0) + 1
        if not counts:
            raise ValueError(f"{store.path}: no calibration samples yet")
        device = max(counts, key=lambda d: (counts[d], d))  # the device calibrated most
    if device not in devices:
        raise ValueError(f"{store.path}: no device {device}")
    return int(device), devices[device]


def _collective_processes(store, device: int) -> Optional[int]:
    runs = [r for r in store.runs() if r["device_id"] == device and r["plan"] == "collectives"
            and r["info"].get("gpus_per_node")]
    return int(runs[-1]["info"]["gpus_per_node"]) if runs else None


def training_sets(store_path, *, device: Optional[int] = None, dtype: Optional[str] = None,
                  source: Optional[str] = None, at=None, causal_kernel: Optional[str] = None):
    """The samples as the predictors' TrainingSets, keyed by (op, phase) like load_cluster.

    ``file_index`` is 0 (the store) and ``line`` the sample id, so a row the cleaning drops
    can be traced back. One device and one dtype at a time: mixing two machines (or fp16
    with bf16) in one regressor would fit neither; pass device= / dtype= to choose.
    ``at``: a profile/one_speed.OneSpeed the samples are brought to, each by the readings it
    was timed beside or by its step's median; None: as timed. ``causal_kernel``: the kernel the
    device ran causal attention with (TrainingSet.causal_kernel).
    """
    from neox_perf.profile.one_speed import sample_seconds, step_speed
    from neox_perf.calibration.store import SampleStore, feature_names

    with SampleStore(store_path) as store:
        samples = store.samples(device=device, source=source)
    if dtype is not None:
        samples = [s for s in samples if s.dtype == dtype]
    for name, values in (("device", {s.device_id for s in samples}), ("dtype", {s.dtype for s in samples})):
        if len(values) > 1:
            raise ValueError(f"{store_path}: samples of several {name}s ({', '.join(map(str, sorted(values)))}); "
                             f"pass {name}= to choose one")
    nominal = at.seconds_per_loop if at is not None else None
    step = step_speed([s.info for s in samples]) if at is not None and at.mode == "step" else None
    groups: Dict[Tuple[str, str], list] = {}
    for s in samples:
        groups.setdefault((s.op, s.phase), []).append(s)
    return {(op, phase): TrainingSet(
                op, phase, {n: np.array([s.features[n] for s in group], dtype=float)
                            for n in feature_names(op)},
                np.array([sample_seconds(s.seconds, s.info, nominal, step) for s in group], dtype=float),
                np.zeros(len(group), dtype=np.int64), np.array([s.id for s in group], dtype=np.int64),
                causal_kernel=causal_kernel)
            for (op, phase), group in groups.items()}
