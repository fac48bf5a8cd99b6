"""Cluster description files: a cluster nobody sampled, described by its hardware.

    name: dgx-a100
    base: perlmutter-a100-80gb   # a sampled profile whose samples are transferred
    gpu: A100-SXM4-80GB          # a name from `neox-perf clusters --gpus`
    gpus_per_node: 8
    intra_node_GBps: 300         # per GPU, one direction (NVLink / NVSwitch)
    inter_node_Gbps: 1600        # per node, all NICs together

Read with yaml.safe_load only. Every problem is one ProfileError line naming the file, the
key and the fix. Loading the base profile and transferring it is transfer.py's job.
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
    "gpu": Key("gpu", True, "a name from `neox-perf clusters --gpus`"),
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

    def base_path(self) -> str:
        """`base` as load_profile takes it: a bare name, or a path relative to this file."""
        if "/" in self.base or "\\" in self.base:
            p = Path(self.base).expanduser()
            return str(p if p.is_absolute() else self.path.parent / p)
        return self.base


def _fail(path, key: str, problem: str, fix: str) -> ProfileError:
    return ProfileError(path, f"{key}: {problem}", fix)


def _value(path, key: str, spec: Key, value: Any):
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
                            "use a name listed by `neox-perf clusters --gpus`")
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
        return int(value)
    if not math.isfinite(value) or value <= 0:
        raise _fail(path, key, f"must be a positive number, got {value!r}", f"write {key}: <{spec.doc}>")
    if spec.kind == "fraction" and value > 1:
        raise _fail(path, key, f"is a fraction of the line rate, got {value!r}", "write a number in (0, 1]")
    return float(value)


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
    values = {k: _value(path, k, KEYS[k], v) for k, v in data.items() if v is not None}
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
        tf32=values.get("tf32"))


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
