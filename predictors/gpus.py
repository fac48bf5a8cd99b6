"""Accelerators a cluster description can name, with the figures of their vendors' data sheets.

Pure data and a lookup: `neox-perf check` reads this on its fast path.

Conventions: memory is the data sheet's capacity read as GiB (HBM stacks come in powers of
two; `nvidia-smi` shows 40960 MiB for a "40 GB" A100); bandwidths are GB/s (10^9 bytes/s);
FLOP rates are dense (no 2:4 sparsity), fp16/bf16 on the tensor cores (AMD: matrix cores),
fp32 on the vector units. `sms` counts streaming multiprocessors (NVIDIA) or compute units
(AMD); `boost_mhz` is the peak clock. None where the data sheet does not state a figure.
"""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

GiB = 1 << 30


@dataclass(frozen=True)
class GPU:
    name: str
    vendor: str
    memory_gib: float
    memory_type: str
    hbm_gbps: float
    fp16_tflops: float  # dense fp16/bf16 tensor (matrix) core rate
    fp32_tflops: float  # fp32 on the vector units, no tensor cores
    sms: Optional[int]
    boost_mhz: Optional[int]
    source: str
    note: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(round(self.memory_gib * GiB))

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel at peak is compute-bound."""
        return self.fp16_tflops * 1e12 / (self.hbm_gbps * 1e9)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["memory_bytes"] = self.memory_bytes
        out["ridge_flops_per_byte"] = round(self.ridge_flops_per_byte, 1)
        return out


_A100 = "NVIDIA A100 Tensor Core GPU Datasheet (2021)"
_H100 = "NVIDIA H100 Tensor Core GPU Datasheet (2023)"

GPUS: Tuple[GPU, ...] = (
    GPU("A100-SXM4-40GB", "NVIDIA", 40, "HBM2", 1555, 312, 19.5, 108, 1410, _A100),
    GPU("A100-SXM4-80GB", "NVIDIA", 80, "HBM2e", 2039, 312, 19.5, 108, 1410, _A100),
    GPU("A100-PCIe-80GB", "NVIDIA", 80, "HBM2e", 1935, 312, 19.5, 108, 1410, _A100,
        "300 W board: sustained clocks sit below the SXM4 part's under load"),
    GPU("H100-SXM5-80GB", "NVIDIA", 80, "HBM3", 3350, 989, 67, 132, 1980, _H100),
    GPU("H100-PCIe-80GB", "NVIDIA", 80, "HBM2e", 2000, 756, 51, 114, 1755, _H100),
    GPU("H200-SXM-141GB", "NVIDIA", 141, "HBM3e", 4800, 989, 67, 132, 1980,
        "NVIDIA H200 Tensor Core GPU Datasheet (2024)"),
    GPU("GH200-96GB", "NVIDIA", 96, "HBM3", 4000, 989, 67, 132, 1980,
        "NVIDIA GH200 Grace Hopper Superchip Datasheet (2023)",
        "the GPU of the superchip; the device name says 120GB after the Grace CPU's LPDDR5X"),
    GPU("L40S", "NVIDIA", 48, "GDDR6", 864, 362, 91.6, 142, 2520,
        "NVIDIA L40S GPU for AI and Graphics Datasheet (2023)", "GDDR6, no NVLink: PCIe between GPUs"),
    GPU("B200", "NVIDIA", 180, "HBM3e", 8000, 2250, 75, None, None,
        "NVIDIA DGX B200 Datasheet (2024), per GPU (1,440 GB, 72/36 PFLOPS sparse over 8 GPUs)",
        "SM count and clock are not in the data sheet"),
    GPU("MI250X", "AMD", 128, "HBM2e", 3277, 383, 47.9, 220, 1700,
        "AMD Instinct MI250X Accelerator Datasheet (2021)",
        "two dies, each its own device to PyTorch: name MI250X-GCD for one rank"),
    GPU("MI250X-GCD", "AMD", 64, "HBM2e", 1638, 191.5, 23.95, 110, 1700,
        "AMD Instinct MI250X Accelerator Datasheet (2021), one of its two graphics compute dies",
        "half of every MI250X figure: what one PyTorch device (one rank) sees"),
    GPU("MI300X", "AMD", 192, "HBM3", 5300, 1307, 163.4, 304, 2100,
        "AMD Instinct MI300X Accelerator Datasheet (2023)"),
)

_BY_KEY: Dict[str, GPU] = {}


def _key(name: str) -> str:
    text = "".join(ch for ch in str(name).lower() if ch.isalnum())
    for prefix in ("nvidia", "amdinstinct", "amd"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


for _gpu in GPUS:
    _BY_KEY[_key(_gpu.name)] = _gpu
# Device names as torch.cuda.get_device_name() spells them (and as the published samples'
# file names do), for the GPU of a sampled profile.
_ALIASES = {"A100-SXM4-40GB": "A100-SXM4-40GB", "A100-SXM-80GB": "A100-SXM4-80GB",
            "A100 80GB PCIe": "A100-PCIe-80GB", "H100 80GB HBM3": "H100-SXM5-80GB",
            "H100 PCIe": "H100-PCIe-80GB", "H100-SXM5": "H100-SXM5-80GB", "H100-PCIe": "H100-PCIe-80GB",
            "H200": "H200-SXM-141GB", "GH200 120GB": "GH200-96GB", "GH200 480GB": "GH200-96GB",
            "GH200": "GH200-96GB", "B200-180GB": "B200", "MI250X/MI250": "MI250X"}
for _alias, _target in _ALIASES.items():
    _BY_KEY.setdefault(_key(_alias), _BY_KEY[_key(_target)])


def find_gpu(name: str) -> Optional[GPU]:
    """The table row for a name (case, spaces, dashes and an NVIDIA/AMD prefix ignored)."""
    return _BY_KEY.get(_key(name))


def gpu(name: str) -> GPU:
    found = find_gpu(name)
    if found is None:
        raise KeyError(f"unknown GPU {name!r}{did_you_mean(name)}")
    return found


def did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(str(name).upper(), [g.name.upper() for g in GPUS], n=2, cutoff=0.5)
    names = [g.name for g in GPUS if g.name.upper() in close]
    return f"; did you mean {' or '.join(names)}?" if names else ""


def names() -> List[str]:
    return [g.name for g in GPUS]
