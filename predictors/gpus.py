"""Accelerators a cluster description can name, with the figures of their vendors' data sheets.

Pure data and a lookup: `neox-perf check` reads this on its fast path.

Conventions: memory is the data sheet's capacity read as GiB (HBM stacks come in powers of
two; `nvidia-smi` shows 40960 MiB for a "40 GB" A100); bandwidths are GB/s (10^9 bytes/s);
FLOP rates are dense (no 2:4 sparsity), fp16/bf16 on the tensor cores (AMD: matrix cores),
fp32 on the vector units, TF32 on the tensor cores (NVIDIA Ampere and later; data sheets print
it with sparsity, "989*": the dense rate is half). `sms` counts streaming multiprocessors (NVIDIA) or compute units
(AMD); `boost_mhz` is the peak clock. None where the data sheet does not state a figure.

Beside each data-sheet peak, the ACHIEVABLE dense rate per precision (`achievable()`): the
largest GEMM rate a vendor library (cuBLAS, hipBLASLt) was measured to sustain on that GPU, from
public measurements named in every figure. A data-sheet peak is not achievable: it assumes every
tensor core busy at the boost clock, while a long GEMM runs below it (power, clocks, tiling).
Where no measurement of a GPU exists, a figure is derived from a measured sibling and says so
(`Rate.measured` False, the source names the sibling); where none is close enough, there is no
figure and callers must say so (predictors/achievable.py). docs/achievable-rates.md has the table.
"""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Tuple

GiB = 1 << 30

# The precisions a rate is given for: fp16 / bf16 on the tensor (matrix) cores, TF32 (fp32
# inputs rounded to 10 mantissa bits on the tensor cores, NVIDIA Ampere and later), and plain
# fp32 (IEEE single precision: SGEMM on the vector units).
PRECISIONS = ("fp16", "bf16", "tf32", "fp32")
_ALIASES_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                      "float": "fp32", "fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "tf32": "tf32"}


def precision_key(precision: str) -> str:
    """fp16 | bf16 | tf32 | fp32 for the names configs and calibrations use (bfloat16, float32...)."""
    key = _ALIASES_PRECISION.get(str(precision).lower())
    if key is None:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    return key


@dataclass(frozen=True)
class Rate:
    """An achievable dense rate: TFLOP/s, where it was measured (or how it was derived)."""

    tflops: float
    source: str
    measured: bool = True  # False: derived from a measured sibling, which `source` names

    def to_dict(self) -> dict:
        return {"tflops": self.tflops, "source": self.source, "measured": self.measured}


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
    # dense TF32 tensor-core rate (what fp32 matmuls run at where TF32 is allowed:
    # predictors/achievable.py); None where the data sheet gives none (AMD, the DGX B200 sheet)
    tf32_tflops: Optional[float] = None
    bf16: bool = True  # False: no bf16 on this chip (Volta: fp16 tensor cores only)
    # A description's own GPU (from_datasheet): its achievable rates, measured by the user or
    # derived from its data sheet (derived_rates); None for a table row (ACHIEVABLE has them).
    rates: Optional[Tuple[Tuple[str, Rate], ...]] = None

    @property
    def memory_bytes(self) -> int:
        return int(round(self.memory_gib * GiB))

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel at peak is compute-bound."""
        return self.fp16_tflops * 1e12 / (self.hbm_gbps * 1e9)

    def peak_tflops(self, precision: str) -> Optional[float]:
        """The data sheet's dense rate for a precision (None where the data sheet gives none,
        and for bf16 on a chip without it)."""
        key = precision_key(precision)
        return {"fp16": self.fp16_tflops, "bf16": self.fp16_tflops if self.bf16 else None,
                "tf32": self.tf32_tflops, "fp32": self.fp32_tflops}.get(key)

    def achievable_rates(self) -> Dict[str, Rate]:
        return dict(self.rates) if self.rates is not None else ACHIEVABLE.get(self.name, {})

    def achievable(self, precision: str) -> Optional[Rate]:
        """The measured (or visibly derived) dense GEMM rate for a precision; None where no
        public measurement of this GPU or a close sibling exists."""
        return self.achievable_rates().get(precision_key(precision))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("rates")
        out["memory_bytes"] = self.memory_bytes
        out["ridge_flops_per_byte"] = round(self.ridge_flops_per_byte, 1)
        out["achievable_tflops"] = {k: r.to_dict() for k, r in self.achievable_rates().items()}
        return out


_A100 = "NVIDIA A100 Tensor Core GPU Datasheet (2021)"
# V100 SXM2: 125 TFLOPS tensor (fp16 only: Volta has no bf16), 15.7 TFLOPS fp32, 900 GB/s HBM2,
# 16 or 32 GB (NVIDIA Tesla V100 GPU Accelerator Datasheet, 2020); 80 SMs at a 1530 MHz boost
# clock (NVIDIA Tesla V100 GPU Architecture whitepaper, 2017, Table 1).
_V100 = "NVIDIA Tesla V100 GPU Accelerator Datasheet (2020); SMs and clock: the Volta whitepaper (2017)"
_H100 = "NVIDIA H100 Tensor Core GPU Datasheet (2023)"

GPUS: Tuple[GPU, ...] = (
    # TF32: A100 156 (312 with sparsity); H100 SXM5 989* and PCIe 756* halved, 494.7 and 378
    # dense in NVIDIA's H100 Tensor Core GPU Architecture whitepaper (Table 1); H200 and GH200
    # 989* (the same GH100 at the same clocks); L40S 366*. V100: no TF32 (Volta).
    GPU("V100-SXM2-16GB", "NVIDIA", 16, "HBM2", 900, 125, 15.7, 80, 1530, _V100,
        "no bf16: a bf16 run is refused (train in fp16)", bf16=False),
    GPU("V100-SXM2-32GB", "NVIDIA", 32, "HBM2", 900, 125, 15.7, 80, 1530, _V100,
        "no bf16: a bf16 run is refused (train in fp16)", bf16=False),
    GPU("A100-SXM4-40GB", "NVIDIA", 40, "HBM2", 1555, 312, 19.5, 108, 1410, _A100, tf32_tflops=156),
    GPU("A100-SXM4-80GB", "NVIDIA", 80, "HBM2e", 2039, 312, 19.5, 108, 1410, _A100, tf32_tflops=156),
    GPU("A100-PCIe-80GB", "NVIDIA", 80, "HBM2e", 1935, 312, 19.5, 108, 1410, _A100,
        "300 W board: sustained clocks sit below the SXM4 part's under load", tf32_tflops=156),
    GPU("H100-SXM5-80GB", "NVIDIA", 80, "HBM3", 3350, 989, 67, 132, 1980, _H100, tf32_tflops=494.7),
    GPU("H100-PCIe-80GB", "NVIDIA", 80, "HBM2e", 2000, 756, 51, 114, 1755, _H100, tf32_tflops=378),
    GPU("H200-SXM-141GB", "NVIDIA", 141, "HBM3e", 4800, 989, 67, 132, 1980,
        "NVIDIA H200 Tensor Core GPU Datasheet (2024)", tf32_tflops=494.7),
    GPU("GH200-96GB", "NVIDIA", 96, "HBM3", 4000, 989, 67, 132, 1980,
        "NVIDIA GH200 Grace Hopper Superchip Datasheet (2023)",
        "the GPU of the superchip; the device name says 120GB after the Grace CPU's LPDDR5X",
        tf32_tflops=494.7),
    GPU("L40S", "NVIDIA", 48, "GDDR6", 864, 362, 91.6, 142, 2520,
        "NVIDIA L40S GPU for AI and Graphics Datasheet (2023)", "GDDR6, no NVLink: PCIe between GPUs",
        tf32_tflops=183),
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

# ---- achievable dense rates (TFLOP/s), each with where it was measured -----------------------
_MAMF = ("S. Bekman, Machine Learning Engineering, 'Maximum Achievable Matmul FLOPS comparison "
         "table' (github.com/stas00/ml-engineering, compute/accelerator/README.md): torch.matmul, "
         "the best shape of a search, mean of 100 runs after 50 warm-up")
_AMD_MAF = ("AMD ROCm blog 'Measuring Max-Achievable FLOPs - Part 2' (Sander et al., Feb 2025), "
            "Table 1: hipBLASLt-bench at the median clock, cold caches, normal-distributed data")
_TORCH_DB = "zzc0721/torch-performance-test-data (GitHub), torch.matmul of square matrices 1024-10240, best size"
_SAME_RATE = ("the bf16 figure: the tensor (matrix) cores run fp16 and bf16 at one rate on this chip "
              "(data sheet), and no fp16 shape search is published")


def _derived(sibling: str, why: str) -> Dict[str, Rate]:
    """Every rate of a measured sibling, marked derived and saying why it carries over."""
    return {k: Rate(r.tflops, f"derived from {sibling} ({why}): {r.source}", False)
            for k, r in ACHIEVABLE[sibling].items()}


def _tf32_of_board(sibling: str, bf16: float) -> Rate:
    """TF32 of a PCIe board from its SXM sibling's measured TF32, scaled by the two boards'
    measured bf16 rates: TF32 runs on the same tensor cores, at the clocks the board's power
    limit leaves, which its measured bf16 rate shows and its data sheet does not (the A100
    PCIe's sheet says 156 like the SXM4's)."""
    tf32, ref = ACHIEVABLE[sibling]["tf32"], ACHIEVABLE[sibling]["bf16"]
    return Rate(round(tf32.tflops * bf16 / ref.tflops, 2),
                f"derived from {sibling}'s measured TF32 {tf32.tflops:g} x the two boards' measured "
                f"bf16 ratio {bf16:g}/{ref.tflops:g} (same tensor cores; {tf32.source})", False)


ACHIEVABLE: Dict[str, Dict[str, Rate]] = {}
ACHIEVABLE["A100-SXM4-80GB"] = {
    "bf16": Rate(271.2, f"{_MAMF}; v2 table, NVIDIA A100 SXM, torch 2.6.0+cu126"),
    "fp16": Rate(271.2, _SAME_RATE, False),
    "tf32": Rate(134.2, "PyTorch docs, CUDA semantics, 'TensorFloat-32 (TF32) on Ampere (and later) "
                        "devices': a 10240x10240 fp32 matmul takes 0.016 s on GA100 with TF32 "
                        "(0.11 s without)"),
    "fp32": Rate(19.18, f"{_TORCH_DB}, database.md row 'NVIDIA A100 SXM4 80GB' (PyTorch 2.8.0, CUDA 12.8)"),
}
ACHIEVABLE["A100-SXM4-40GB"] = _derived("A100-SXM4-80GB", "the same GA100 SXM4 part at the same "
                                        "clocks and 400 W; only the memory differs")
ACHIEVABLE["A100-PCIe-80GB"] = {
    "bf16": Rate(252.9, f"{_MAMF}; v2 table, NVIDIA A100 PCIe, torch 2.5.1+cu124"),
    "fp16": Rate(252.9, _SAME_RATE, False),
    "tf32": _tf32_of_board("A100-SXM4-80GB", 252.9),
    "fp32": Rate(18.88, "Yinghan-Li/YHs_Sample issue #4 (GitHub): cuBLAS SGEMM on an A100 80GB "
                        "PCIe, 5120x4096x4096"),
}
ACHIEVABLE["H100-SXM5-80GB"] = {
    "bf16": Rate(794.5, f"{_MAMF}; v2 table, NVIDIA H100 SXM, torch 2.7.0+cu126"),
    "fp16": Rate(794.5, _SAME_RATE + " (a square-only fp16 run reached 760.0: issue #79 of "
                        "zzc0721/torch-performance-test-data)", False),
    "tf32": Rate(402.15, f"{_TORCH_DB}, issue #79 'NVIDIA H100 80GB HBM3' (PyTorch 2.7.0, CUDA 12.8)"),
    "fp32": Rate(51.88, f"{_TORCH_DB}, issue #79 'NVIDIA H100 80GB HBM3' (PyTorch 2.7.0, CUDA 12.8)"),
}
ACHIEVABLE["H100-PCIe-80GB"] = {
    "bf16": Rate(499.5, "mag-/gpu_benchmark README (GitHub): mamf-finder.py with an Optuna shape "
                        "search, NVIDIA H100 PCIe"),
    "fp16": Rate(499.5, _SAME_RATE, False),
    "tf32": _tf32_of_board("H100-SXM5-80GB", 499.5),
    "fp32": Rate(round(51.88 * 51 / 67, 2), "derived from H100-SXM5-80GB's measured 51.88 x the data "
                 "sheets' fp32 ratio 51/67 (same GH100 die, fewer SMs and a lower clock)", False),
}
ACHIEVABLE["H200-SXM-141GB"] = _derived("H100-SXM5-80GB", "the same GH100 die at the same 700 W; "
                                        "only the HBM3e memory differs")
ACHIEVABLE["GH200-96GB"] = {
    "bf16": Rate(828.6, f"{_MAMF}; v2 table, NVIDIA GH200 SXM, torch 2.6.0+cu126, measured on the "
                        "900 W 144 GB HBM3e module (the GPU of this 96 GB HBM3 part)"),
    "fp16": Rate(828.6, _SAME_RATE, False),
    **{k: r for k, r in _derived("H100-SXM5-80GB", "the same GH100 GPU; no GH200 measurement").items()
       if k in ("tf32", "fp32")},
}
ACHIEVABLE["B200"] = {
    "fp16": Rate(1627.64, f"{_TORCH_DB}, database.md row 'NVIDIA B200 180GB' (GCP a4-highgpu-8g, "
                          "PyTorch 2.8.0); square matrices only, no shape search"),
    "bf16": Rate(1696.03, f"{_TORCH_DB}, database.md row 'NVIDIA B200 180GB' (GCP a4-highgpu-8g, "
                          "PyTorch 2.8.0); square matrices only, no shape search"),
    "fp32": Rate(66.24, f"{_TORCH_DB}, database.md row 'NVIDIA B200 180GB' (GCP a4-highgpu-8g, PyTorch 2.8.0)"),
}
ACHIEVABLE["MI250X-GCD"] = {
    "bf16": Rate(147.0, f"{_MAMF}; older v1 table (no cache reset), AMD MI250X, ROCm 6.2, one GCD"),
    "fp16": Rate(147.0, _SAME_RATE, False),
}
ACHIEVABLE["MI250X"] = {k: Rate(2 * r.tflops, f"derived: two GCDs, each {r.tflops:g} ({r.source})", False)
                        for k, r in ACHIEVABLE["MI250X-GCD"].items()}
ACHIEVABLE["MI300X"] = {
    "fp16": Rate(654.0, f"{_AMD_MAF} (1115 MHz)"),
    "bf16": Rate(708.0, f"{_AMD_MAF} (1207 MHz)"),
}
# V100: no public shape-search measurement was found; its rates are derived from its data sheet
# (derived_rates below), like any GPU a description gives by its figures.
# L40S: no public GEMM measurement of it or of a sibling at its power and clocks was found
# (the RTX 4090 shares the die but not the fp32-accumulate tensor rate): no figure.

def transfer_rates(base: GPU, target: GPU, precision: str = "fp16") -> Tuple[float, float, str]:
    """(base, target) TFLOP/s a compute-bound kernel's time moves by between two GPUs: their
    achievable rates where both have one (an H100's GEMM is 794.5/271.2 times an A100's, not
    989/312), else both data-sheet peaks; and which of the two it is."""
    a, b = base.achievable(precision), target.achievable(precision)
    if a is not None and b is not None:
        return a.tflops, b.tflops, "achievable"
    return base.peak_tflops(precision), target.peak_tflops(precision), "data-sheet peak"


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


# ---- a GPU the table does not have: from its data sheet ----------------------------------
_TENSOR = ("fp16", "bf16")


def _measured_fractions(vendor: str, precision: str) -> List[Tuple[str, float]]:
    """(GPU, achievable / data-sheet peak) of every table row of this vendor whose rate for the
    precision class (tensor: fp16 or bf16; fp32) was measured, not derived."""
    kinds = _TENSOR if precision in _TENSOR else (precision,)
    out = []
    for g in GPUS:
        if g.vendor != vendor:
            continue
        for k in kinds:
            r, peak = ACHIEVABLE.get(g.name, {}).get(k), g.peak_tflops(k)
            if r is not None and r.measured and peak:
                out.append((f"{g.name} {k}", r.tflops / peak))
    return out


def derived_rates(g: GPU) -> Dict[str, Rate]:
    """Achievable rates of a GPU nobody measured, derived as the table derives a rate from a
    sibling: its data-sheet peak times what the measured rows of its vendor reach of theirs
    (the median, so no one chip sets it). A100 SXM reaches 0.87 of its bf16 peak, H100 PCIe
    0.66; the median of NVIDIA's measured tensor rates is 0.80, of fp32 0.93. Marked derived,
    with the fraction and the rows it came from."""
    out: Dict[str, Rate] = {}
    for precision in ("fp16", "bf16", "fp32"):
        peak = g.peak_tflops(precision)
        fractions = _measured_fractions(g.vendor, precision)
        if not peak or not fractions:
            continue
        values = sorted(f for _, f in fractions)
        mid = len(values) // 2
        median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
        out[precision] = Rate(round(peak * median, 2),
                              f"derived from {g.name}'s data-sheet {peak:g} TFLOP/s x {median:.3f}, the "
                              f"median achievable/peak of the table's {len(values)} measured {g.vendor} "
                              f"{'tensor' if precision in _TENSOR else precision} rates "
                              f"({', '.join(n for n, _ in fractions)}); no measurement of this GPU",
                              False)
    return out


def rates_from_datasheet(g: GPU) -> List[str]:
    """The precisions whose achievable rate derived_rates made from g's data sheet."""
    return [k for k, r in g.achievable_rates().items()
            if not r.measured and r.source.startswith(f"derived from {g.name}'s data-sheet")]


ACHIEVABLE["V100-SXM2-32GB"] = derived_rates(gpu("V100-SXM2-32GB"))
ACHIEVABLE["V100-SXM2-16GB"] = derived_rates(gpu("V100-SXM2-16GB"))

# The keys of a GPU given by its data sheet in a cluster description (`gpu: {...}`).
DATASHEET_KEYS = {
    "name": "the GPU's name, as reports show it",
    "memory_GiB": "memory per GPU as the data sheet states it (a 32 GB V100: 32)",
    "hbm_GBps": "memory bandwidth, GB/s (a V100: 900)",
    "fp16_tflops": "dense fp16 tensor-core TFLOP/s, no sparsity (a V100: 125)",
    "fp32_tflops": "fp32 TFLOP/s on the vector units, no tensor cores (a V100: 15.7)",
    "bf16_tflops": "dense bf16 TFLOP/s; leave it out where the chip has no bf16 (Volta)",
    "sms": "streaming multiprocessors (AMD: compute units)",
    "mhz": "peak (boost) clock, MHz",
    "vendor": "NVIDIA (default) or AMD",
    "memory_type": "HBM2, HBM3, GDDR6, ...",
    "achievable_tflops": "what you measured a long GEMM reach: {fp16: ..., bf16: ..., fp32: ...}",
}
DATASHEET_REQUIRED = ("name", "memory_GiB", "hbm_GBps", "fp16_tflops", "fp32_tflops")


def from_datasheet(values: Dict[str, object], where: str) -> GPU:
    """A GPU from a description's already-checked data-sheet figures (cluster_file checks each
    key's type and range): its rates are the user's measured ones where given, the rest derived
    (derived_rates). `where` names the file the figures came from."""
    fp16 = float(values["fp16_tflops"])
    has_bf16 = values.get("bf16_tflops") is not None
    g = GPU(str(values["name"]), str(values.get("vendor") or "NVIDIA"), float(values["memory_GiB"]),
            str(values.get("memory_type") or "HBM"), float(values["hbm_GBps"]), fp16,
            float(values["fp32_tflops"]), values.get("sms"), values.get("mhz"),
            f"data sheet figures given in {where}",
            "described by its data sheet" + ("" if has_bf16 else "; no bf16 rate given: a bf16 run is refused"),
            bf16=has_bf16)
    rates = derived_rates(g)
    for k, v in dict(values.get("achievable_tflops") or {}).items():
        rates[precision_key(k)] = Rate(float(v), f"measured by the user, given in {where}")
    return replace(g, rates=tuple(sorted(rates.items())))
