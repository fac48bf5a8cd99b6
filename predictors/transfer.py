"""A cluster description's profile: a sampled base profile transferred to other hardware.

Operators (TRANSFER_METHOD, chosen with benchmarks/transfer_gpu.py): the base's prediction t
is scaled by the ratio of the additive roofline on the data-sheet peaks,

    t_target = t * (F/P_t + B/W_t) / (F/P_b + B/W_b)

F and B the operator's FLOPs and bytes (opspec), P and W peak fp16 tensor throughput and
HBM bandwidth of the target (t) and base (b) GPUs. The arithmetic intensity F/B against the
ridge point P/W decides how much of the time follows compute and how much bandwidth: a large
GEMM moves with P, a norm or an optimizer step with W, and an attention batched matmul near
the ridge with both, where the plain roofline max(F/P, B/W) flips wholly to one side. The
additive form is also the profile's own baseline (t0 + F/P + B/W). Measured leave-one-GPU-out
(A100-SXM4-80GB <-> GH200, achievable rates), it beats the plain roofline ratio on every
summary (median MAPE over operators 11.1% vs 12.7% and 11.9% vs 15.0%); keeping the base's fitted fixed cost t0
unscaled ("fixed_additive") helps multi-kernel operators (rope, rmsnorm, cross-entropy) but
loses on single kernels and on the median, so it is not the default. Nothing is fitted on a
target GPU's samples. Operators whose kernels differ between the two software stacks
(embedding backward, layernorm backward, the optimizer) transfer badly whatever the method.

Collectives: NCCL's latency for the described ranks (baseline.collective_latency: per-launch
plus per-step hop latency from NCCL's own cost model, nothing fitted) plus the base's
prediction for the same group less the latency on the base's ranks, that remainder scaled by
the time the described links need to move the wire bytes over the time the base's links need
(so a description equal to its base predicts exactly what the base does). The base's fitted
alpha is not carried over as a fixed cost: its samples (all-reduce >= 42 MB) cannot identify
it, and it put ~85 us on every small all-reduce. Transfer time: wire bytes / bandwidth, ring
or (all-reduce over > 2 nodes) NCCL's tree, whichever is faster;
inside a node an NVSwitch gives any subset of GPUs the full per-GPU bandwidth, point-to-point
NVLink only the links among the group; between nodes a group's members on one node use as
many NICs as they are, and every group crossing the node at the same moment (all ranks are
in one group of each kind and run it in lockstep) shares the node's NICs. Efficiencies (the
fraction of the line rate NCCL reaches) are the base's fitted ones where the base measured
that link, else reference measurements named in the manifest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from neox_perf.prediction import opspec
from neox_perf.profile.facts import ClusterFacts, Link
from neox_perf.profile.models import ModelEntry
from neox_perf.prediction.collective_sources import LINK_MODEL, SAMPLED
from neox_perf.profile.values import Prediction, ProfileInfo

from . import achievable, baseline, gpus, line_rate
from .cluster_file import ClusterDescription
from .errors import ProfileError
from .sampled import collective_args

METHODS = ("roofline", "additive", "fixed_additive")
TRANSFER_METHOD = "additive"

# What NCCL reached on the links the published samples measured, per collective: NVLink 3.0
# on Perlmutter (fitted per-peer bandwidth over the nominal 100 GB/s) and NDR InfiniBand on
# Vista (fitted per-NIC over 50 GB/s); see those profiles' manifest notes. Used where a base
# has no samples of that link class, or the description names another network.
REFERENCE_NVLINK_EFFICIENCY = {"allreduce": 0.73, "allgather": 0.47, "p2p": 0.91}
REFERENCE_NIC_EFFICIENCY = {"allreduce": 0.96, "allgather": 0.97, "p2p": 0.67}
@dataclass(frozen=True)
class Links:
    gpus_per_node: int
    intra_GBps: float  # per GPU, one direction
    topology: str  # nvswitch | pointtopoint
    nics: int
    inter_GBps: float  # per node, all NICs
    eff_intra: Dict[str, float]
    eff_inter: Dict[str, float]
    alpha_intra: Dict[str, float]
    alpha_inter: Dict[str, float]


_hops = baseline.collective_hops


def link_latency(kind: str, nodes: int, gpn: int) -> float:
    """NCCL's latency of the collective (baseline.LATENCY_SOURCE): the same per-launch and
    per-hop figures on any NVLink or NVSwitch node and any InfiniBand-class network, so a link
    description changes it only through the ranks and where they sit."""
    return baseline.collective_latency(kind, nodes, gpn)


def link_transfer(links: Links, kind: str, elements: float, nodes: int, gpn: int,
                  concurrent: int = 1) -> float:
    """Seconds one collective of nodes x gpn ranks spends moving its wire bytes over `links`
    at NCCL's efficiency; `concurrent` groups of this kind cross each node at the same moment."""
    wire = float(opspec.collective_wire_bytes(kind, elements, nodes * gpn))
    if nodes <= 1:
        if links.topology == "nvswitch" or links.gpus_per_node <= 1:
            share = 1.0
        else:  # fully connected: the group drives only the links among its members
            peers = 1 if kind == "p2p" else gpn - 1
            share = peers / (links.gpus_per_node - 1)
        return wire / (links.intra_GBps * 1e9 * share * links.eff_intra[kind])
    per_nic = links.inter_GBps * 1e9 / links.nics
    used = min(1 if kind == "p2p" else gpn, links.nics)
    nics = min(float(used), links.nics / max(concurrent, 1))
    return wire / (per_nic * nics * links.eff_inter[kind])


def link_seconds(links: Links, kind: str, elements: float, nodes: int, gpn: int,
                 concurrent: int = 1) -> float:
    """Seconds of one collective on `links` by the link model alone: latency + transfer."""
    return link_latency(kind, nodes, gpn) + link_transfer(links, kind, elements, nodes, gpn, concurrent)


def _sampled(entry: Optional[ModelEntry]) -> Tuple[bool, bool]:
    topo = (entry.topologies if entry is not None else None) or {}
    return (any(t.nodes == 1 for t in topo.values()), any(t.nodes > 1 for t in topo.values()))


def base_links(base) -> Links:
    """The base's links, with the efficiencies and latencies its samples were fitted to."""
    f = base.facts
    gpn = f.gpus_per_node
    eff_i, eff_e, a_i, a_e = {}, {}, {}, {}
    for kind in opspec.COLLECTIVES:
        entry = base.manifest.collectives.get(kind)
        b = entry.baseline if entry is not None else None
        coef = dict(zip(b.terms, b.coef)) if b is not None else {}
        intra, inter = _sampled(entry)
        peer = b.intra_peer_link_gbps if b is not None else None
        nic = b.inter_per_nic_gbps if b is not None else None
        # baseline.collective_design: a g-GPU ring drives g-1 peer links, so the per-GPU rate
        # is peer x (gpn - 1) (p2p: one peer link); an efficiency against the data sheet.
        nominal_peer = f.intra_node_link.bandwidth_gbps / max(gpn - 1, 1)
        eff_i[kind] = (peer / nominal_peer) if intra and peer else REFERENCE_NVLINK_EFFICIENCY[kind]
        nominal_nic = f.inter_node_link.bandwidth_gbps / max(f.inter_node_link.lanes, 1)
        eff_e[kind] = (nic / nominal_nic) if inter and nic else REFERENCE_NIC_EFFICIENCY[kind]
        a_i[kind] = coef.get("alpha_intra", 0.0) if intra else 0.0
        a_e[kind] = coef.get("alpha_inter", 0.0) if inter else 0.0
    return Links(gpn, f.intra_node_link.bandwidth_gbps, "pointtopoint", max(f.inter_node_link.lanes, 1),
                 f.inter_node_link.bandwidth_gbps, eff_i, eff_e, a_i, a_e)


def target_links(desc: ClusterDescription, base, ref: Links) -> Tuple[Links, Dict[str, str]]:
    """The described links and, per efficiency, where its value came from."""
    same_network = (math.isclose(desc.inter_node_Gbps / 8.0, ref.inter_GBps, rel_tol=1e-6)
                    and desc.nics_per_node == ref.nics)
    eff_i, eff_e, why = {}, {}, {}
    for kind in opspec.COLLECTIVES:
        intra, inter = _sampled(base.manifest.collectives.get(kind))
        if desc.intra_node_efficiency is not None:
            eff_i[kind], why[f"{kind}_intra"] = desc.intra_node_efficiency, "description"
        elif intra:
            eff_i[kind], why[f"{kind}_intra"] = ref.eff_intra[kind], f"fitted on {base.name}"
        else:
            eff_i[kind], why[f"{kind}_intra"] = ref.eff_intra[kind], "reference NVLink 3.0 (perlmutter samples)"
        if desc.inter_node_efficiency is not None:
            eff_e[kind], why[f"{kind}_inter"] = desc.inter_node_efficiency, "description"
        elif inter and same_network:
            eff_e[kind], why[f"{kind}_inter"] = ref.eff_inter[kind], f"fitted on {base.name}"
        else:
            eff_e[kind] = REFERENCE_NIC_EFFICIENCY[kind]
            why[f"{kind}_inter"] = "reference NDR InfiniBand (vista samples)"
    links = Links(desc.gpus_per_node, desc.intra_node_GBps or 0.0, desc.intra_node_topology,
                  desc.nics_per_node, desc.inter_node_Gbps / 8.0, eff_i, eff_e,
                  dict(ref.alpha_intra), dict(ref.alpha_inter))
    return links, why


def operator_ratio(method: str, flops, nbytes, base_gpu: gpus.GPU, target: gpus.GPU):
    """Target/base time of the roofline part for FLOPs and bytes (arrays broadcast). P is the
    achievable fp16 rate (the samples' precision) of both GPUs where the table has both
    (gpus.transfer_rates), else both data-sheet peaks."""
    f = np.asarray(flops, dtype=float)
    b = np.asarray(nbytes, dtype=float)
    pb, pt, _ = gpus.transfer_rates(base_gpu, target)
    pb, pt = pb * 1e12, pt * 1e12
    wb, wt = base_gpu.hbm_gbps * 1e9, target.hbm_gbps * 1e9
    if method == "roofline":
        return np.maximum(f / pt, b / wt) / np.maximum(f / pb, b / wb)
    return (f / pt + b / wt) / (f / pb + b / wb)


class TransferredProfile:
    """A cluster description's profile (neox_perf/profile/protocol.Profile, as ClusterProfile).
    Build with predictors/profile.load_profile()."""

    def __init__(self, desc: ClusterDescription, base, base_gpu: gpus.GPU, path: Optional[Path] = None,
                 method: str = TRANSFER_METHOD):
        if method not in METHODS:
            raise ValueError(f"transfer method must be one of {', '.join(METHODS)}")
        self.description = desc
        self.base = base
        self.base_gpu = base_gpu
        self.gpu = desc.gpu
        self.method = method
        self.path = Path(path or desc.path)
        self.name: str = desc.name
        self.collective_dtype: str = base.collective_dtype
        self.same_gpu = base_gpu == desc.gpu
        self._base_links = base_links(base)
        self.links, link_sources = target_links(desc, base, self._base_links)
        self.facts = ClusterFacts(
            name=desc.name, gpu_name=f"{desc.gpu.vendor} {desc.gpu.name}", gpu_memory_bytes=desc.gpu.memory_bytes,
            gpus_per_node=desc.gpus_per_node,
            intra_node_link=Link(desc.intra_node_link, float(desc.intra_node_GBps or 0.0),
                                 1 if desc.intra_node_topology == "nvswitch" else max(desc.gpus_per_node - 1, 1)),
            inter_node_link=Link(desc.inter_node_link, desc.inter_node_Gbps / 8.0, desc.nics_per_node),
            peak_fp16_tflops=desc.gpu.fp16_tflops, hbm_bandwidth_gbps=desc.gpu.hbm_gbps,
            samples_from=self._samples_line())
        transfer = self._transfer_section(link_sources)
        self.manifest = replace(base.manifest, name=desc.name, facts=self.facts, transfer=transfer,
                                notes=(*transfer["summary"], *desc.notes, *base.manifest.notes))
        self._cache: Dict[tuple, object] = {}

    # ---- what was transferred ----------------------------------------------------------
    def _samples_line(self) -> str:
        if self.same_gpu:
            return f"{self.base_gpu.name} samples of {self.base.name}, links from the description"
        pb, pt, _ = gpus.transfer_rates(self.base_gpu, self.gpu)
        cr = pb / pt
        br = self.base_gpu.hbm_gbps / self.gpu.hbm_gbps
        return (f"{self.base_gpu.name} samples of {self.base.name} transferred to {self.gpu.name}: "
                f"compute-bound time x{cr:.2f}, bandwidth-bound x{br:.2f}")

    def _transfer_section(self, link_sources: Dict[str, str]) -> dict:
        b, t = self.base_gpu, self.gpu
        pb, pt, rates = gpus.transfer_rates(b, t)
        summary = [f"operator and NCCL samples measured on {b.name} ({self.base.name}); "
                   f"memory judged against the {t.name}'s {t.memory_gib:g} GiB"]
        if not self.same_gpu:
            summary.append(
                f"operators transferred {b.name} -> {t.name} by arithmetic intensity: compute-bound "
                f"time x{pb / pt:.3g} ({pb:g} -> {pt:g} TFLOP/s fp16, {rates}), bandwidth-bound x{b.hbm_gbps / t.hbm_gbps:.3g} ({b.hbm_gbps:g} -> "
                f"{t.hbm_gbps:g} GB/s), blended per sample by the {self.method} roofline ratio")
        derived = gpus.rates_from_datasheet(t) if not self.same_gpu else []
        if derived:
            summary.append(f"{t.name}'s achievable {'/'.join(derived)} rates are derived from its data sheet, "
                           f"not measured: {t.achievable(derived[0]).source}")
        if b.vendor != t.vendor:
            summary.append(f"{b.vendor} samples transferred to an {t.vendor} GPU: kernels, libraries and "
                           f"collectives differ beyond what peak rates say; expect large errors")
        summary.append(f"collectives: the base's samples scaled by a link model of {self.facts.gpus_per_node} "
                       f"GPUs/node, {self.description.intra_node_topology} {self.links.intra_GBps:g} GB/s per GPU, "
                       f"{self.description.inter_node_Gbps:g} Gb/s per node over {self.links.nics} NIC(s)")
        return {
            "description": str(self.description.path),
            "base_profile": self.base.name, "base_path": str(self.base.path),
            "samples_gpu": b.name, "samples_device": self.base.facts.gpu_name, "target_gpu": t.name,
            "operators": {"method": "none (same GPU)" if self.same_gpu else self.method,
                          "compute_time_ratio": pb / pt, "compute_rates": rates,
                          "bandwidth_time_ratio": b.hbm_gbps / t.hbm_gbps,
                          "base_ridge_flops_per_byte": b.ridge_flops_per_byte,
                          "target_ridge_flops_per_byte": t.ridge_flops_per_byte},
            "collectives": {"model": "NCCL latency(described ranks) + (base prediction - NCCL latency(base ranks)) "
                                     "x transfer time(described links) / transfer time(base links)",
                            "latency": baseline.LATENCY_SOURCE,
                            "efficiency": {"intra": self.links.eff_intra, "inter": self.links.eff_inter},
                            "efficiency_source": link_sources},
            "summary": summary,
        }

    # ---- operators -----------------------------------------------------------------------
    def operators(self) -> List[Tuple[str, str]]:
        return self.base.operators()

    def collectives(self) -> List[str]:
        return self.base.collectives()

    def _scale(self, op: str, phase: str, seconds, feats):
        if self.same_gpu:
            return seconds
        f = opspec.op_flops(op, phase, feats)
        b = opspec.op_bytes(op, phase, feats)
        ratio = operator_ratio(self.method, f, b, self.base_gpu, self.gpu)
        if self.method != "fixed_additive":
            return seconds * ratio
        t0 = np.minimum(achievable.fixed_cost(self.base, op, phase), seconds)
        return t0 + (seconds - t0) * ratio

    def predict(self, op: str, phase: str, features: Mapping[str, float]):
        pred = self.base.predict(op, phase, features)
        if self.same_gpu:
            return pred
        key = (op, phase, tuple(sorted((k, float(v)) for k, v in features.items())))
        hit = self._cache.get(key)
        if hit is None:
            seconds = float(self._scale(op, phase, pred.seconds, dict(features)))
            hit = replace(pred, seconds=seconds)
            if len(self._cache) < 100_000:
                self._cache[key] = hit
        return hit

    def coverage(self, op: str, phase: str, features: Mapping[str, float]):
        """The base's samples are the ones a transferred prediction stands on."""
        return self.base.coverage(op, phase, features)

    def predict_many(self, op: str, phase: str, features: Mapping[str, object]):
        pred = self.base.predict_many(op, phase, features)
        if self.same_gpu:
            return pred
        spec = opspec.op_spec(op)
        cols = np.broadcast_arrays(*(np.asarray(features[n], dtype=float) for n in spec.features))
        feats = {n: np.ravel(c) for n, c in zip(spec.features, cols)}
        return replace(pred, seconds=np.asarray(self._scale(op, phase, pred.seconds, feats), dtype=float))

    # ---- collectives ---------------------------------------------------------------------
    def predict_collective(self, kind: str, elements: float, nodes: int, gpus_per_node: int):
        elements, nodes, gpn = collective_args(self, kind, elements, nodes, gpus_per_node)
        if nodes * gpn == 1 or elements == 0:
            return Prediction(0.0, False, "")
        key = ("comm", kind, elements, nodes, gpn)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if kind == "p2p":  # one sender, one receiver: only whether the pair crosses nodes matters
            nodes, gpn = (2, 1) if nodes > 1 else (1, 2)
        concurrent = max(self.facts.gpus_per_node // gpn, 1)
        target = link_transfer(self.links, kind, elements, nodes, gpn, concurrent)
        latency = link_latency(kind, nodes, gpn)
        intra, inter = _sampled(self.base.manifest.collectives.get(kind))
        base_gpn = min(gpn, self._base_links.gpus_per_node)
        if (intra if nodes <= 1 else inter) and (nodes > 1 or base_gpn > 1 or kind == "p2p"):
            ref = self.base.predict_collective(kind, elements, nodes, base_gpn)
            # the base's time less NCCL's latency on its ranks is what its links spent moving
            # bytes: that part scales with the links, the latency is the target's own
            ref_transfer = link_transfer(self._base_links, kind, elements, nodes, base_gpn)
            ref_latency = link_latency(kind, nodes, base_gpn)
            if target == ref_transfer and latency == ref_latency:
                seconds = ref.seconds
            else:
                seconds = latency + max(ref.seconds - ref_latency, 0.0) * target / ref_transfer
            # the described links are the sampled ones (the groups sharing a node's NICs at once
            # aside: derived from the NIC count and the placement, not a link model's guess) --
            # the base's measured fabric prices it; else the link model does
            alone = link_transfer(self.links, kind, elements, nodes, gpn, 1)
            source = SAMPLED if alone == ref_transfer and latency == ref_latency else LINK_MODEL
            reasons = [ref.reason] if ref.reason else []
            if base_gpn != gpn:
                reasons.append(f"{kind}: {gpn} GPUs/node never sampled on {self.base.name}; scaled from "
                               f"its {nodes}x{base_gpn} by the link model")
            out = Prediction(seconds, bool(reasons), "; ".join(reasons), source)
        else:
            where = "intra-node" if nodes <= 1 else "inter-node"
            out = Prediction(latency + target, True, f"{kind}: no {where} samples on {self.base.name}; link model "
                                           f"with reference efficiency only", LINK_MODEL)
        out = line_rate.at_least(self.facts, out, kind, elements, nodes, gpn)
        if len(self._cache) < 100_000:
            self._cache[key] = out
        return out

    def info(self):
        return ProfileInfo(self.name, self.path, self.gpu.name,
                           f"description {self.description.path.name}; {self.facts.samples_from}")

    def __repr__(self) -> str:
        return f"TransferredProfile({self.name!r}, gpu={self.gpu.name!r}, base={self.base.name!r})"


def base_gpu_of(desc: ClusterDescription, base) -> gpus.GPU:
    if desc.base_gpu is not None:
        return desc.base_gpu
    found = gpus.find_gpu(base.facts.gpu_name)
    if found is None:
        raise ProfileError(desc.path, f"base: the GPU of {base.name} ({base.facts.gpu_name!r}) is not in the "
                                      f"GPU table, so its samples cannot be transferred",
                           "add base_gpu: <a name from `neox-perf clusters --gpus`>")
    return found
