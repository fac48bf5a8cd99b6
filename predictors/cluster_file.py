"""Cluster description files: a cluster nobody sampled, described by its hardware.

    name: dgx-a100
    base: perlmutter-a100-80gb   # a sampled profile whose samples are transferred
    gpu: A100-SXM4-80GB          # a name from `neox-perf clusters --gpus`, or the data sheet's
                                 # figures: {name: V100-SXM2-32GB, memory_GiB: 32, hbm_GBps: 900,
                                 #  fp16_tflops: 125, fp32_tflops: 15.7, sms: 80, mhz: 1530}
    gpus_per_node: 8
    intra_node_GBps: 300         # per GPU, one direction (NVLink / NVSwitch)
    inter_node_Gbps: 1600        # per node, all NICs together

Read with yaml.safe_load only. Every problem is one ProfileError line naming the file, the
key and the fix. Every number is checked against the physical range of its kind (RANGES, each
sourced): outside it, one line naming the key, the value and the likely unit slip; near its
edges, a warning the description carries into every report. Loading the base profile and
transferring it is transfer.py's job.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from . import gpus
from .errors import ProfileError

DESCRIPTION_FILE = "cluster.yml"  # a description inside a profile directory
TOPOLOGIES = ("nvswitch", "pointtopoint")


@dataclass(frozen=True)
class Key:
    kind: str  # str | int | number | fraction | topology | gpu | strings | bool
    required: bool
    doc: str


KEYS: Dict[str, Key] = {
    "name": Key("str", True, "the cluster's name, as reports show it"),
    "base": Key("str", True, "a sampled profile (name or directory) whose samples are transferred"),
    "gpu": Key("gpu", True, "a name from `neox-perf clusters --gpus`, or the data sheet's figures "
                            "{name: ..., memory_GiB: ..., hbm_GBps: ..., fp16_tflops: ..., fp32_tflops: ...}"),
    "gpus_per_node": Key("int", True, "GPUs (ranks) per node"),
    "intra_node_GBps": Key("number", False, "GB/s per GPU, one direction, inside a node "
                                            "(required with more than one GPU per node)"),
    "inter_node_Gbps": Key("number", True, "Gb/s per node between nodes, all NICs together"),
    "intra_node_topology": Key("topology", False, "nvswitch (any GPU subset gets the full "
                                                  "per-GPU bandwidth) or pointtopoint (a link per "
                                                  "GPU pair); default nvswitch"),
    "nics_per_node": Key("int", False, "NICs per node; default one per GPU"),
    "intra_node_link": Key("str", False, "name of the intra-node link, for reports"),
    "inter_node_link": Key("str", False, "name of the network, for reports"),
    "intra_node_efficiency": Key("fraction", False, "fraction of the intra-node line rate NCCL reaches; "
                                                    "default: what the base measured on NVLink"),
    # What a network really delivers does not follow from its line rate (Perlmutter's
    # Slingshot-10 samples reach 19% of it, Vista's NDR InfiniBand 96%): set it when known.
    "inter_node_efficiency": Key("fraction", False, "fraction of the NIC line rate NCCL reaches; default: "
                                                    "the base's when its network is the same, else "
                                                    "what InfiniBand NDR measured (vista-gh200)"),
    # NGC's PyTorch containers (GPT-NeoX's Dockerfile builds on one) set
    # TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (pytorch/pytorch PR #77114); PyTorch alone leaves it off
    "tf32": Key("bool", False, "true: fp32 matmuls run as TF32 here (NGC containers, NeoX's Dockerfile); "
                               "false: IEEE fp32; unset: neox-perf's default, its interval reaching the other"),
    "base_gpu": Key("gpu", False, "the base profile's GPU, when its device name is not in the table"),
    "notes": Key("strings", False, "free-text lines copied into the report"),
}


@dataclass(frozen=True)
class Range:
    """Where a value of one kind can physically lie. Outside [lo, hi]: refused, naming the unit
    slip (a value in `slip_low[0]` units is `slip_low[1]` of this key's; likewise above). Inside
    but below warn_lo or above warn_hi: accepted with a warning."""

    unit: str
    lo: float
    hi: float
    warn_lo: float
    warn_hi: float
    what_lo: str  # what the low end is
    what_hi: str
    slip_low: Optional[Tuple[str, float]] = None
    slip_high: Optional[Tuple[str, float]] = None


RANGES: Dict[str, Range] = {
    # A node's links together: one 10 GbE NIC (IEEE 802.3ae) at the bottom; eight 800 Gb/s
    # NICs (NVIDIA ConnectX-8 SuperNIC data sheet: 800 Gb/s XDR InfiniBand per port) at the top.
    # Above 3,200 (eight 400 Gb/s NDR: DGX H100 User Guide) only XDR nodes: warned.
    "inter_node_Gbps": Range("Gb/s per node", 10, 6400, 25, 3200,
                             "one 10 GbE NIC", "eight 800 Gb/s XDR NICs",
                             ("Tb/s", 1000), ("Mb/s", 0.001)),
    # Per GPU, one direction: PCIe 3.0 x4 (3.94 GB/s; PCI-SIG) at the bottom, NVLink 5 (1.8 TB/s
    # per GPU both directions, 900 one way: NVIDIA Blackwell data sheet) at the top. Below PCIe
    # 4.0 x16's 32 GB/s (PCI-SIG) only old or narrow PCIe links: warned.
    "intra_node_GBps": Range("GB/s per GPU, one direction", 3.9, 900, 16, 900,
                             "PCIe 3.0 x4", "NVLink 5, the fastest GPU link",
                             ("TB/s", 1000), ("Gb/s", 1 / 8)),
    # GPUs (ranks) per node: 1 (GH200) to 16 (HGX-2: 16 V100s on NVSwitch; NVIDIA HGX-2 data
    # sheet); a 72-GPU NVLink domain (GB200 NVL72) spans 18 nodes of 4.
    "gpus_per_node": Range("GPUs per node", 1, 72, 1, 16, "one GPU", "a 72-GPU NVLink domain"),
    # NICs per node: 1 to 8 compute NICs on every node above (DGX, HGX, Perlmutter: 4); 16+ rare.
    "nics_per_node": Range("NICs per node", 1, 32, 1, 16, "one NIC", "32 NICs"),
    # What NCCL reaches of a link's line rate: Slingshot-10 reached 19% of it in the published
    # samples (perlmutter-a100-80gb), NDR InfiniBand 96% (vista-gh200); below 10% warned.
    "intra_node_efficiency": Range("of the line rate", 1e-3, 1, 0.1, 1, "0.1%", "the whole line rate"),
    "inter_node_efficiency": Range("of the line rate", 1e-3, 1, 0.1, 1, "0.1%", "the whole line rate"),
}
# A GPU given by its data sheet (gpu: {...}); the same rule.
GPU_RANGES: Dict[str, Range] = {
    # 4 GiB (a T4 has 16; nothing that trains has less than 4) to 1,024; above MI355X's 288
    # GB (AMD data sheet) warned. nvidia-smi shows MiB: 40960 is 40 GiB.
    "memory_GiB": Range("GiB", 4, 1024, 8, 300, "the smallest GPU that trains", "1 TiB", ("TiB", 1024), ("MiB", 1 / 1024)),
    # HBM/GDDR bandwidth: ~100 GB/s (the slowest GDDR cards) to 10,000; above B200's 8,000
    # GB/s (DGX B200 data sheet) warned, below 300 (a T4: 320) warned.
    "hbm_GBps": Range("GB/s", 100, 10000, 300, 8000, "the slowest GDDR cards", "any HBM stack", ("TB/s", 1000), ("MB/s", 0.001)),
    # Dense 16-bit tensor rate: a T4's 65 TFLOP/s (T4 data sheet) down to 10; above B200's 2,250
    # dense (DGX B200 data sheet) warned; above 10,000 a sparse or FP8/FP4 figure.
    "fp16_tflops": Range("TFLOP/s dense", 10, 10000, 30, 3000, "any tensor core", "any dense 16-bit rate (a sparse or FP8 figure?)",
                         ("PFLOP/s", 1000), ("GFLOP/s", 0.001)),
    "bf16_tflops": Range("TFLOP/s dense", 10, 10000, 30, 3000, "any tensor core",
                         "any dense 16-bit rate (a sparse or FP8 figure?)",
                         ("PFLOP/s", 1000), ("GFLOP/s", 0.001)),
    # fp32 on the vector units: 1 to 500 TFLOP/s; MI300X's 163.4 (AMD data sheet) is the most in
    # the table: above 200 (a tensor-core TF32 or 16-bit figure?) warned.
    "fp32_tflops": Range("TFLOP/s", 1, 500, 4, 200, "any GPU's vector units", "any vector unit (a tensor-core figure?)",
                         ("PFLOP/s", 1000), ("GFLOP/s", 0.001)),
    # Boost clocks: 300 MHz to 4 GHz (L40S: 2,520 MHz, the table's most).
    "mhz": Range("MHz", 300, 4000, 700, 3000, "any GPU clock", "any GPU clock", ("GHz", 1000), ("kHz", 0.001)),
    "sms": Range("SMs", 1, 1000, 8, 400, "one SM", "any GPU"),
}


def check_range(path, key: str, value: float, rng: Range) -> Optional[str]:
    """None, or a warning for a value near its range's edge; a value outside it is refused."""
    if value < rng.lo or value > rng.hi:
        low = value < rng.lo
        edge, what = (rng.lo, rng.what_lo) if low else (rng.hi, rng.what_hi)
        slip = rng.slip_low if low else rng.slip_high
        guess = (f": did you write {slip[0]}? ({value:g} {slip[0]} is {value * slip[1]:g} {rng.unit})"
                 if slip else "")
        raise _fail(path, key, f"{value:g} {rng.unit} is {'below' if low else 'above'} the {edge:g} of "
                               f"{what}{guess}", f"write {key} in {rng.unit}")
    if value < rng.warn_lo or value > rng.warn_hi:
        side = "low" if value < rng.warn_lo else "high"
        return (f"{path}: {key}: {value:g} {rng.unit} is unusually {side} (range {rng.lo:g}-{rng.hi:g}); "
                f"check it is in {rng.unit}")
    return None


@dataclass(frozen=True)
class ClusterDescription:
    path: Path
    name: str
    base: str
    gpu: gpus.GPU
    gpus_per_node: int
    intra_node_GBps: Optional[float]
    inter_node_Gbps: float
    intra_node_topology: str
    nics_per_node: int
    intra_node_link: str
    inter_node_link: str
    intra_node_efficiency: Optional[float]
    inter_node_efficiency: Optional[float]
    base_gpu: Optional[gpus.GPU]
    notes: Tuple[str, ...]
    raw: Dict[str, Any]
    tf32: Optional[bool] = None  # fp32 matmuls as TF32; None: not said (predictors/achievable.py)
    warnings: Tuple[str, ...] = ()  # values near the edge of their physical range (RANGES)

    def base_path(self) -> str:
        """`base` as load_profile takes it: a bare name, or a path relative to this file."""
        if "/" in self.base or "\\" in self.base:
            p = Path(self.base).expanduser()
            return str(p if p.is_absolute() else self.path.parent / p)
        return self.base


def _fail(path, key: str, problem: str, fix: str) -> ProfileError:
    return ProfileError(path, f"{key}: {problem}", fix)


def _gpu_mapping(path, key: str, value: dict, warnings: list) -> gpus.GPU:
    """A GPU given by its data sheet's figures, each checked like any description value."""
    for k in value:
        if k not in gpus.DATASHEET_KEYS:
            close = difflib.get_close_matches(str(k), list(gpus.DATASHEET_KEYS), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(gpus.DATASHEET_KEYS)}"
            raise _fail(path, f"{key}.{k}", "unknown key", hint)
    for k in gpus.DATASHEET_REQUIRED:
        if value.get(k) is None:
            raise _fail(path, f"{key}.{k}", "missing", f"add {k}: <{gpus.DATASHEET_KEYS[k]}>")
    out: Dict[str, Any] = {}
    for k, v in value.items():
        if v is None:
            continue
        name = f"{key}.{k}"
        if k in ("name", "vendor", "memory_type"):
            if not isinstance(v, str) or not v.strip():
                raise _fail(path, name, f"must be a non-empty string, got {v!r}", f"write {k}: <{gpus.DATASHEET_KEYS[k]}>")
            out[k] = v.strip()
        elif k == "achievable_tflops":
            if not isinstance(v, dict):
                raise _fail(path, name, "must be a mapping of precision to TFLOP/s", "write achievable_tflops: {fp16: ...}")
            rates = {}
            for prec, rate in v.items():
                try:
                    pk = gpus.precision_key(prec)
                except ValueError:
                    raise _fail(path, f"{name}.{prec}", "unknown precision", "use fp16, bf16, tf32 or fp32") from None
                rates[pk] = _number(path, f"{name}.{prec}", rate, "TFLOP/s you measured")
            out[k] = rates
        else:
            number = _number(path, name, v, gpus.DATASHEET_KEYS[k])
            if k in ("sms", "mhz"):
                if int(number) != number:
                    raise _fail(path, name, f"must be a whole number, got {v!r}", f"write {k}: <{gpus.DATASHEET_KEYS[k]}>")
                number = int(number)
            warning = check_range(path, name, number, GPU_RANGES[k])
            if warning:
                warnings.append(warning)
            out[k] = number
    if out.get("vendor", "NVIDIA") not in {g.vendor for g in gpus.GPUS}:
        raise _fail(path, f"{key}.vendor", f"unknown vendor {out['vendor']!r}", "write NVIDIA or AMD")
    peaks = {"fp16": out["fp16_tflops"], "bf16": out.get("bf16_tflops"), "fp32": out["fp32_tflops"]}
    for prec, rate in out.get("achievable_tflops", {}).items():
        if peaks.get(prec) and rate > peaks[prec] * 1.05:
            raise _fail(path, f"{key}.achievable_tflops.{prec}", f"{rate:g} TFLOP/s is above the data sheet's "
                        f"{peaks[prec]:g}", "give the rate a long GEMM sustained, at most the data-sheet peak")
    return gpus.from_datasheet(out, str(path))


def _number(path, key: str, value: Any, doc: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(path, key, f"must be a positive number, got {value!r}", f"write {key.split('.')[-1]}: <{doc}>")
    return float(value)


def _value(path, key: str, spec: Key, value: Any, warnings: Optional[list] = None):
    warnings = [] if warnings is None else warnings
    if spec.kind == "gpu" and isinstance(value, dict):
        return _gpu_mapping(path, key, value, warnings)
    if spec.kind in ("str", "topology", "gpu"):
        if not isinstance(value, str) or not value.strip():
            raise _fail(path, key, f"must be a non-empty string, got {value!r}", f"write {key}: <{spec.doc}>")
        value = value.strip()
        if spec.kind == "topology" and value.lower() not in TOPOLOGIES:
            raise _fail(path, key, f"unknown topology {value!r}", f"use one of {', '.join(TOPOLOGIES)}")
        if spec.kind == "topology":
            return value.lower()
        if spec.kind == "gpu":
            found = gpus.find_gpu(value)
            if found is None:
                raise _fail(path, key, f"unknown GPU {value!r}{gpus.did_you_mean(value)}",
                            "use a name listed by `neox-perf clusters --gpus`, or give its data sheet: "
                            "gpu: {name: ..., memory_GiB: ..., hbm_GBps: ..., fp16_tflops: ..., fp32_tflops: ...}")
            return found
        return value
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise _fail(path, key, f"must be true or false, got {value!r}", f"write {key}: true  (or false)")
        return value
    if spec.kind == "strings":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _fail(path, key, "must be a list of strings", f"write {key}: [\"...\"]")
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, key, f"must be a number, got {value!r}", f"write {key}: <{spec.doc}>")
    if spec.kind == "int":
        if int(value) != value or value < 1:
            raise _fail(path, key, f"must be a whole number >= 1, got {value!r}", f"write {key}: <{spec.doc}>")
        value = int(value)
    elif not math.isfinite(value) or value <= 0:
        raise _fail(path, key, f"must be a positive number, got {value!r}", f"write {key}: <{spec.doc}>")
    elif spec.kind == "fraction" and value > 1:
        raise _fail(path, key, f"is a fraction of the line rate, got {value!r}", "write a number in (0, 1]")
    if key in RANGES:
        warning = check_range(path, key, value, RANGES[key])
        if warning:
            warnings.append(warning)
    return value if spec.kind == "int" else float(value)


def parse(data: Any, path: Path) -> ClusterDescription:
    if not isinstance(data, dict):
        raise ProfileError(path, "a cluster description is a YAML mapping of keys",
                           f"write at least {', '.join(k for k, s in KEYS.items() if s.required)}")
    for key in data:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), list(KEYS), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(KEYS)}"
            raise _fail(path, str(key), "unknown key", hint)
    for key, spec in KEYS.items():
        if spec.required and data.get(key) is None:
            raise _fail(path, key, "missing", f"add {key}: <{spec.doc}>")
    warnings: list = []
    values = {k: _value(path, k, KEYS[k], v, warnings) for k, v in data.items() if v is not None}
    gpn = values["gpus_per_node"]
    if gpn > 1 and "intra_node_GBps" not in values:
        raise _fail(path, "intra_node_GBps", f"missing, and {gpn} GPUs per node need a link between them",
                    "add intra_node_GBps: <GB/s per GPU, one direction>")
    topology = values.get("intra_node_topology", "nvswitch")
    return ClusterDescription(
        path=path, name=values["name"], base=values["base"], gpu=values["gpu"], gpus_per_node=gpn,
        intra_node_GBps=values.get("intra_node_GBps"), inter_node_Gbps=values["inter_node_Gbps"],
        intra_node_topology=topology, nics_per_node=values.get("nics_per_node", gpn),
        intra_node_link=values.get("intra_node_link", "none (1 GPU per node)" if gpn == 1
                                   else "NVSwitch" if topology == "nvswitch" else "NVLink"),
        inter_node_link=values.get("inter_node_link", "network"),
        intra_node_efficiency=values.get("intra_node_efficiency"),
        inter_node_efficiency=values.get("inter_node_efficiency"),
        base_gpu=values.get("base_gpu"), notes=values.get("notes", ()), raw=dict(data),
        tf32=values.get("tf32"), warnings=tuple(warnings))


def read(path: Path) -> ClusterDescription:
    import yaml
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ProfileError(path, f"unreadable cluster description ({exc.strerror or exc})",
                           "check the path and its permissions") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ProfileError(path, f"not valid YAML{where} ({getattr(exc, 'problem', None) or exc})",
                           "fix the YAML syntax") from None
    except UnicodeDecodeError:
        raise ProfileError(path, "not a text file", "point at a cluster description YAML") from None
    return parse(data, Path(path))


def is_description(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in (".yml", ".yaml")


def bundled_description(name: str) -> Optional[Path]:
    """The bundled description file of a bare name (`dgx-a100`), or None."""
    from neox_perf.profile.directory import bundled_descriptions_dir
    for suffix in (".yml", ".yaml"):
        path = bundled_descriptions_dir() / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def bundled_descriptions() -> Tuple[Path, ...]:
    from neox_perf.profile.directory import bundled_descriptions_dir
    root = bundled_descriptions_dir()
    return tuple(sorted(p for p in root.iterdir() if is_description(p))) if root.is_dir() else ()
