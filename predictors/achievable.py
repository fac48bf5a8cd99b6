"""What one operator call can cost at least on the GPU a profile describes, in the precision the
run computes in: the rule every operator prediction passes through (`estimate`, called by
`predict.predict` for check, plan, validate and the run hook, and by the step-term fit).

1. Precision. A profile's operator samples were timed in one precision (the bundled GPU
   samples: fp16). A run in another is priced on the same GPU by the additive roofline of
   achievable rates, the form transfer.operator_ratio uses between GPUs:

       t_run = t0 + (t_samples - t0) * (F / P_run + B_run / W) / (F / P_samples + B_samples / W)

   F the call's FLOPs, B its bytes at each precision's element size (fp32 moves twice the
   bytes of fp16), P the GPU's achievable dense rate per precision (gpus.Rate) for the matmul
   operators (corrections.COMPUTE_BOUND) and its fp32 vector rate in both precisions for the
   rest (elementwise math runs on the vector units whatever the storage type), W its HBM
   bandwidth, t0 the model's fitted fixed cost (its baseline's constant: launch and framework
   overhead, the same whatever the element type; a tiny kernel is not 14x slower in fp32). A
   GEMM priced from fp16 samples in fp32 slows by up to P_fp16 / P_fp32 (14x on an A100: 271
   vs 19 TFLOP/s), a norm by its doubled bytes. A run a profile cannot price this way (no
   fp32 rate for its GPU, or no GPU row at all) is refused in one line, never predicted from
   16-bit samples unadjusted.

   TF32, the third way. An fp32 run's matmuls run as TF32 on the tensor cores where the
   cluster allows it (torch.backends.cuda.matmul.allow_tf32, or the environment variable
   TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 of pytorch/pytorch PR #77114, which NVIDIA's PyTorch
   containers set). One rule: the matmul operators (COMPUTE_BOUND) are priced at the matmul
   precision's rate -- TF32's achievable rate there, IEEE fp32's otherwise -- while bytes stay
   fp32's (4 per element) and the other operators stay on the vector units. The same rule
   reads the samples: fp32 samples calibrated with TF32 on are TF32 matmul samples. Where the
   run's matmuls run comes from, first found: the run itself (the hook's record, for
   `report`), the cluster description's `tf32:`, the calibrated profile's facts (`calibrate`
   records its machine's flags), else DEFAULT_TF32 (fp32_matmuls()); predict.predict then
   prices the other way too and widens the 80% interval to reach it.

2. Cap. No call is predicted faster than its FLOPs at the GPU's achievable rate for the run's
   matmul precision (TF32's for an fp32 run with TF32 matmuls): t >= F / P_run. The samples
   are short bursts (the mean of the 3rd-7th fastest of 10 runs, warm caches): their largest
   GEMMs beat what a long GEMM sustains (Perlmutter A100 up to 301 TFLOP/s against 271
   measured by a shape search over 100-run means; Vista GH200 up to 977 against 829), and a
   training step runs them back to back for hours. A capped
   call is flagged like an extrapolated one. Bytes are not capped: opspec's byte counts are
   first-order (no cache reuse), and the samples show elementwise operators beyond HBM
   bandwidth where their tensors sit in L2 (Perlmutter res_add 2.5 TB/s on a 2.0 TB/s part).
   A GPU without an achievable figure for the precision is capped at its data-sheet peak, and
   the flag says so.

CPU-calibrated profiles (and any profile whose device is not in the GPU table and whose samples
are in the run's precision) have no GPU row: nothing is rescaled or capped there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

from neox_perf.prediction import opspec
from neox_perf.prediction.corrections import COMPUTE_BOUND

from . import gpus
from .errors import ProfileError

SAMPLES_DEFAULT = "fp16"  # the published operator samples (and so the bundled profiles)
_WIDTH = {"fp16": 2, "bf16": 2, "tf32": 4, "fp32": 4}


def gpu_of(profile) -> Optional[gpus.GPU]:
    """The GPU-table row of a profile (neox_perf.profile.protocol.Profile) by its device name (a
    description's facts name its table row); None for a CPU calibration or a device the table
    does not know. A description's GPU is its own (one given by its data sheet has no table row)."""
    own = getattr(profile, "gpu", None)
    if isinstance(own, gpus.GPU):
        return own
    return gpu_of_facts(profile.facts)


def gpu_of_facts(facts) -> Optional[gpus.GPU]:
    """gpu_of for a profile's facts alone (the trainers clean samples before a profile exists)."""
    name = str(facts.gpu_name or "")
    if not name or name.endswith("(CPU)"):
        return None
    return gpus.find_gpu(name)


def samples_precision(profile) -> str:
    """The precision a profile's operator models predict in: the run a level correction scaled
    them to (`calibrate --from-run`), else its calibration's dtype, else the published fp16."""
    manifest = profile.manifest
    recalibrated = manifest.provenance.recalibrated if manifest.provenance is not None else None
    dtype = recalibrated.get("dtype") if recalibrated else None
    dtype = dtype or (manifest.calibration.dtype if manifest.calibration is not None else None)
    try:
        return gpus.precision_key(dtype) if dtype else SAMPLES_DEFAULT
    except ValueError:
        return SAMPLES_DEFAULT


# ---- TF32: where an fp32 run's matmuls run --------------------------------------------------
# The default where neither the run, the cluster description nor the calibration says: TF32.
# GPT-NeoX's own Dockerfile builds on NVIDIA's PyTorch container (nvcr.io/nvidia/pytorch:24.02-py3),
# and NVIDIA's containers set TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (pytorch/pytorch PR #77114), so
# there fp32 matmuls run as TF32 whatever NeoX leaves torch.backends.cuda.matmul.allow_tf32 at.
# PyTorch on its own leaves TF32 off for matmuls since 1.12 (docs: notes/cuda.rst, "TensorFloat-32
# (TF32) on Ampere (and later) devices"): that other pricing bounds the interval (predict.predict).
DEFAULT_TF32 = True
DEFAULT_WHY = "default: NeoX's Dockerfile runs in NVIDIA's PyTorch container, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1"


@dataclass(frozen=True)
class Fp32Matmuls:
    """How an fp32 run's matmuls are priced on a cluster, and who said so."""

    tf32: bool  # True: as TF32 on the tensor cores; False: as IEEE fp32 on the vector units
    source: str  # "cluster description x.yml tf32: true", "default: ...", "the run: ..."
    known: bool  # False where the default was taken: predict.predict prices the other way too
    # the iteration priced the other way, where the default was taken and the GPU has both rates
    other_seconds: Optional[float] = None

    @property
    def name(self) -> str:
        return "TF32" if self.tf32 else "IEEE fp32"

    @property
    def other_name(self) -> str:
        return "IEEE fp32" if self.tf32 else "TF32"

    def text(self) -> str:
        """One clause for the verdict line: which pricing, and its source."""
        reach = (f"; the 80% interval reaches {self.other_name}'s {self.other_seconds:.3g} s"
                 if self.other_seconds is not None else "")
        return f"fp32 matmuls as {self.name} ({self.source}{reach})"

    def to_dict(self) -> dict:
        return {"matmuls": "tf32" if self.tf32 else "ieee_fp32", "source": self.source,
                "known": self.known, "other_seconds": self.other_seconds, "text": self.text()}


def cluster_tf32(profile) -> Tuple[Optional[bool], str]:
    """(whether fp32 matmuls run as TF32 on the profile's cluster, who says so): a cluster
    description's `tf32:`, else a calibrated profile's facts; (None, "") where neither says."""
    desc = getattr(profile, "description", None)
    if desc is not None:  # a description's cluster is not its base's machine
        if getattr(desc, "tf32", None) is None:
            return None, ""
        return desc.tf32, f"cluster description {Path(desc.path).name} tf32: {'true' if desc.tf32 else 'false'}"
    tf32 = getattr(profile.facts, "tf32", None)
    if tf32 is None:
        return None, ""
    return tf32, f"profile {profile.name}: its calibration ran fp32 matmuls as {'TF32' if tf32 else 'IEEE fp32'}"


def fp32_matmuls(profile, tf32: Optional[bool] = None, source: str = "") -> Fp32Matmuls:
    """Where an fp32 run's matmuls run on `profile`: `tf32` where the caller knows (the run's own
    record; `source` says so), else the cluster's (cluster_tf32), else DEFAULT_TF32 -- IEEE fp32
    where the GPU has no TF32 rate to price a default at."""
    if tf32 is not None:
        return Fp32Matmuls(bool(tf32), source or f"tf32: {'true' if tf32 else 'false'}", True)
    said, why = cluster_tf32(profile)
    if said is not None:
        return Fp32Matmuls(said, why, True)
    gpu = gpu_of(profile)
    if DEFAULT_TF32 and gpu is not None and gpu.achievable("tf32") is None:
        return Fp32Matmuls(False, f"no TF32 rate for {gpu.name} in the GPU table", False)
    return Fp32Matmuls(DEFAULT_TF32, DEFAULT_WHY, False)


def samples_tf32(profile) -> Optional[bool]:
    """Whether a profile's fp32 samples ran their matmuls as TF32: the run a level correction
    scaled them to (`calibrate --from-run` records it), else the calibrated machine's facts (a
    description's samples are its base's); None where neither recorded it (limits then takes
    fp32 samples to run as the run does: nothing to rescale)."""
    manifest = profile.manifest
    recalibrated = manifest.provenance.recalibrated if manifest.provenance is not None else None
    if recalibrated and recalibrated.get("dtype") and recalibrated.get("tf32") is not None:
        return bool(recalibrated["tf32"])
    if recalibrated and recalibrated.get("dtype"):
        return None  # corrected to a run that did not record its TF32
    measured = getattr(profile, "base", None) or profile
    tf32 = getattr(measured.facts, "tf32", None)
    return None if tf32 is None else bool(tf32)


def matmul_precision(precision: str, tf32: bool) -> str:
    """The precision a matmul of a `precision` run (or sample) runs in: fp32 -> tf32 where TF32 is on."""
    return "tf32" if precision == "fp32" and tf32 else precision


def rate(gpu: gpus.GPU, precision: str) -> Tuple[Optional[float], str]:
    """(TFLOP/s, what it is) a cap uses: the achievable rate, else the data-sheet peak."""
    found = gpu.achievable(precision)
    if found is not None:
        kind = "measured" if found.measured else "derived"
        return found.tflops, f"{gpu.name}'s achievable {precision} rate, {found.tflops:g} TFLOP/s ({kind})"
    peak = gpu.peak_tflops(precision)
    if peak is None:
        return None, f"no {precision} rate for {gpu.name}"
    return peak, (f"{gpu.name}'s data-sheet {precision} peak, {peak:g} TFLOP/s (no measured achievable "
                  f"rate in the GPU table)")


@dataclass(frozen=True)
class OperatorLimits:
    """The precision rescale and the cap for one (profile, run precision)."""

    gpu: gpus.GPU
    precision: str  # the run's: fp16 | bf16 | fp32 (its element type: bytes)
    samples: str  # the profile's samples'
    cap_tflops: float
    cap_what: str
    # (samples' rate, run's rate) TFLOP/s when the run is priced from samples of another
    # precision; None when the samples already are the run's precision (or run at its rate)
    rescale_tflops: Optional[Tuple[float, float]] = None
    profile: object = field(default=None, compare=False, repr=False)  # whose models' fixed costs stay
    matmul: str = ""  # the run's matmul precision (tf32 for an fp32 run with TF32); "" = precision
    fp32_matmuls: Optional[Fp32Matmuls] = None  # for an fp32 run: which, and who said so

    def rescaled(self, call, seconds: float) -> float:
        """Isolated seconds of `call` in the run's precision from its samples' prediction; the
        model's fixed cost (fixed_cost()) does not scale."""
        if self.rescale_tflops is None:
            return seconds
        if call.op in COMPUTE_BOUND:
            ps, pr = (p * 1e12 for p in self.rescale_tflops)
        else:
            ps = pr = self.gpu.fp32_tflops * 1e12
        w = self.gpu.hbm_gbps * 1e9
        phase = opspec.OPTIMIZER_PHASE if call.op == "optimizer" else call.phase
        feats = call.feature_dict()
        b_s = float(opspec.op_bytes(call.op, phase, feats, _WIDTH[self.samples]))
        b_r = float(opspec.op_bytes(call.op, phase, feats, _WIDTH[self.precision]))
        f = float(call.flops)
        t0 = min(max(fixed_cost(self.profile, call.op, phase), 0.0), seconds)
        return t0 + (seconds - t0) * (f / pr + b_r / w) / (f / ps + b_s / w)

    def capped(self, call, seconds: float) -> Tuple[float, str]:
        """(seconds, why it was raised, or "") under the achievable-rate floor."""
        floor = float(call.flops) / (self.cap_tflops * 1e12)
        if seconds >= floor:
            return seconds, ""
        return floor, (f"predicted {float(call.flops) / seconds / 1e12:.0f} TFLOP/s, capped at "
                       f"{self.cap_what}")

    def note(self) -> Optional[str]:
        """What a run's notes should say about its precision, or None."""
        if self.rescale_tflops is None:
            return None
        ps, pr = self.rescale_tflops
        mm = self.fp32_matmuls
        return (f"{self.precision} run priced from {self.samples} operator samples at {self.gpu.name}'s "
                f"achievable rates ({ps:g} -> {pr:g} TFLOP/s, bytes x{_WIDTH[self.precision] // _WIDTH[self.samples]}"
                + (f"; matmuls as {mm.name}: {mm.source}" if mm is not None else "") + ")")


def fixed_cost(profile, op: str, phase: str) -> float:
    """Seconds of a profile's model of (op, phase) that do not depend on the work: its
    baseline's constant (0 where the model has none, e.g. a stand-in or a derived phase)."""
    entry = profile.manifest.model(op, phase)
    coef = entry.baseline.coef if entry is not None and entry.baseline is not None else None
    return float(coef[0]) if coef else 0.0


def limits(profile, precision: str, tf32: Optional[bool] = None, tf32_source: str = "") -> Optional[OperatorLimits]:
    """The rescale and cap for runs in `precision` on `profile`; None where the profile has no
    GPU row and its samples are the run's precision (a CPU calibration). `tf32`: whether an
    fp32 run's matmuls run as TF32 where the caller knows (the run's record; `tf32_source`
    says whose), else the cluster's or the default (fp32_matmuls). Raises a one-line
    ProfileError where a run cannot be priced honestly."""
    samples = samples_precision(profile)
    run = gpus.precision_key(precision) if precision else samples
    gpu = gpu_of(profile)
    wider = _WIDTH[run] != _WIDTH[samples]
    where = profile.path
    if gpu is None:
        if wider:
            device = profile.facts.gpu_name
            raise ProfileError(where, f"{run} run: the operator samples are {samples} and the device "
                                      f"{device!r} is not in the GPU table, so there is no {run} rate to "
                                      f"price them at",
                               f"calibrate this machine in {run}, or use a profile whose GPU the table names")
        return None
    mm = fp32_matmuls(profile, tf32, tf32_source) if run == "fp32" else None
    run_mm = matmul_precision(run, mm is not None and mm.tf32)
    said = samples_tf32(profile)
    samples_mm = matmul_precision(samples, run_mm == "tf32" if said is None else said)
    if run_mm == "tf32" and gpu.achievable("tf32") is None:
        raise ProfileError(where, f"fp32 run with TF32 matmuls ({mm.source}) on {gpu.name}: no TF32 rate "
                                  f"for this GPU (docs/achievable-rates.md), so neox-perf cannot price it",
                           "set tf32: false in the cluster description if its fp32 matmuls run as IEEE "
                           "fp32, or train in fp16/bf16")
    cap, what = rate(gpu, run_mm)
    if run == "bf16" and not gpu.bf16:
        raise ProfileError(where, f"bf16 run on {gpu.name}: this GPU has no bf16 (its data sheet gives no bf16 "
                                  f"rate{'; Volta tensor cores are fp16 only' if 'V100' in gpu.name else ''})",
                           "train in fp16 (precision: fp16, fp16: {enabled: true}), or give the GPU's "
                           "bf16_tflops if its data sheet has one")
    if cap is None:
        raise ProfileError(where, f"{run} run on {gpu.name}: no measured {run} GEMM rate for this GPU "
                                  f"(docs/achievable-rates.md), so neox-perf cannot price {run} there",
                           f"train in fp16/bf16, or calibrate a profile on this GPU in {run}")
    rescale = None
    if run_mm != samples_mm:
        have, want = gpu.achievable(samples_mm), gpu.achievable(run_mm)
        if (wider or "tf32" in (run_mm, samples_mm)) and (have is None or want is None):
            missing = " or ".join(p for p, r in ((samples_mm, have), (run_mm, want)) if r is None)
            raise ProfileError(where, f"{run} run on {gpu.name}: no measured {missing} GEMM rate for this GPU "
                                      f"(docs/achievable-rates.md), so its {samples_mm} samples cannot be priced "
                                      f"in {run_mm}",
                               f"train in {samples}, or calibrate a profile on this GPU in {run}")
        if have is not None and want is not None and (wider or have.tflops != want.tflops):
            rescale = (have.tflops, want.tflops)
    return OperatorLimits(gpu, run, samples, cap, what, rescale, profile, matmul=run_mm, fp32_matmuls=mm)


def other_limits(found: OperatorLimits) -> Optional[OperatorLimits]:
    """The same run priced the other way (TF32 <-> IEEE fp32) where its fp32 matmuls were the
    default's guess and the GPU has both rates; None otherwise."""
    mm = found.fp32_matmuls
    if mm is None or mm.known or found.gpu.achievable("tf32") is None:
        return None
    if found.samples == "fp32" and samples_tf32(found.profile) is None:
        return None  # fp32 samples of unrecorded TF32: no second pricing to tell from the first
    try:
        return limits(found.profile, found.precision, not mm.tf32, "the other end of the default's interval")
    except ProfileError:
        return None


def mfu_peak_tflops(profile, precision: str, tf32: Optional[bool] = None) -> Optional[float]:
    """The data-sheet peak model FLOPs utilisation is quoted against: the run's matmul precision
    on the profile's GPU (fp32 runs against the fp32 rate, or TF32's where their matmuls run as
    TF32: fp32_matmuls), else the profile's facts (fp16 peak)."""
    gpu = gpu_of(profile) if profile is not None else None
    if gpu is not None and precision:
        try:
            key = gpus.precision_key(precision)
            if key == "fp32":
                key = matmul_precision(key, fp32_matmuls(profile, tf32).tf32)
            peak = gpu.peak_tflops(key)
        except ValueError:
            peak = None
        if peak:
            return peak
    return profile.facts.peak_fp16_tflops if profile is not None else None
