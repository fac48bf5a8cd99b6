"""No prediction implies more FLOP/s per GPU than the GPU can sustain (issue #24, section 4).

Every shipped config (neox_perf/examples/*.yml, and GPT-NeoX's own configs under
../shared/data/gpt-neox-configs when present) x every GPU in the table x fp16 / bf16 / fp32
with IEEE matmuls / fp32 with TF32 matmuls / fp32 as the cluster leaves it (the default),
predicted through `predict.predict` (the path check, plan, validate and the hook share):
model FLOPs per iteration / predicted seconds / GPUs <= the GPU's achievable dense rate for
the precision its matmuls run in (gpus.Rate; the data-sheet peak for the one row without a
measured figure, L40S, named below so that fallback cannot spread unseen). A GPU the table
cannot price fp32 (or TF32) on refuses the run in one line instead.

Layouts, sampled: each config at its own pipeline and tensor-parallel sizes with data
parallel 2, and the same model as plain data parallel 2 (no pipeline engine, no tensor
parallel: the layout whose GEMMs run largest and whose collectives hide most). A config that
sets no batch gets one micro-batch per GPU. Memory is not judged (it does not bound speed).

Model FLOPs follow derive/flops.py, which counts the full s x s attention product for flash
attention too (Megatron's convention, so MFU stays comparable); causal flash attention skips
the tiles above the diagonal (opspec.causal_work_fraction), so the bound is on the model FLOPs
that run: the scores' share scaled by that fraction (it matters at 16k tokens, codellama).
"""
from pathlib import Path

import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.config.loader import RawConfig
from neox_perf.derive import derive
from neox_perf.errors import NeoxPerfError
from neox_perf.prediction.opspec import causal_work_fraction
from neox_perf.prediction.predict import predict
from neox_perf.predictors import achievable, cluster_file, gpus, transfer
from neox_perf.predictors.profile import load_profile

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "neox_perf" / "examples"
NEOX_CONFIGS = REPO.parent / "shared" / "data" / "gpt-neox-configs"

PRECISIONS = {
    "fp16": {"fp16": {"enabled": True}, "bf16": {"enabled": False}, "precision": None},
    "bf16": {"fp16": {"enabled": False}, "bf16": {"enabled": True}, "precision": None},
    "fp32": {"fp16": {"enabled": False}, "bf16": {"enabled": False}, "precision": None},
}
# how an fp32 run's matmuls are priced: as IEEE fp32, as TF32, and as the cluster leaves it
# (achievable.DEFAULT_TF32); the bound is the rate of the precision they ran in
FP32_MATMULS = {"fp32": False, "tf32": True, "default": None}
NO_ACHIEVABLE_FIGURE = {"L40S"}  # bounded by the data sheet: see docs/achievable-rates.md


def _profiles():
    """A description per GPU row (the perlmutter-a100-80gb samples transferred to it, DGX-like
    8-GPU nodes), the shipped descriptions (examples/clusters, the bundled perlmutter-a100)
    and the two sampled profiles as they are."""
    base = load_profile("perlmutter-a100-80gb")
    out = []
    for g in gpus.GPUS:
        desc = cluster_file.parse({"name": f"any-{g.name}", "base": base.name, "gpu": g.name,
                                   "gpus_per_node": 8, "intra_node_GBps": 300, "inter_node_Gbps": 1600},
                                  Path(f"<{g.name}>"))
        out.append(transfer.TransferredProfile(desc, base, transfer.base_gpu_of(desc, base)))
    shipped = [load_profile(str(p)) for p in sorted((EXAMPLES / "clusters").glob("*.yml"))]
    return out + shipped + [load_profile("perlmutter-a100"), base, load_profile("vista-gh200")]


def _variants(path: Path):
    """(label, cfg by GPUs per node, derived by GPUs per node) of a config's sampled layouts
    and precisions; those NeoX refuses are left out."""
    try:
        raw = load_files([str(path)])
    except NeoxPerfError:
        return
    for layout in ("own", "data parallel"):
        for precision, overlay in PRECISIONS.items():
            values = dict(raw.values)
            values.update(overlay)
            if values.get("train_micro_batch_size_per_gpu") is None and values.get("train_batch_size") is None:
                values["train_micro_batch_size_per_gpu"] = 1
            values.pop("train_batch_size", None)
            if layout == "data parallel":
                values.update(pipe_parallel_size=0, model_parallel_size=1)
            pp, mp = max(values.get("pipe_parallel_size") or 0, 1), values.get("model_parallel_size") or 1
            built = {}
            for gpn in (8, 4, 1):
                try:
                    cfg, verdicts, _ = build(RawConfig(values=values, sources=dict(raw.sources), files=list(raw.files)),
                                             WorldRequest(gpus=pp * mp * 2, gpus_per_node=gpn))
                    if not any(v.level == "error" for v in verdicts):
                        built[gpn] = (cfg, derive(cfg, 50257))
                except (NeoxPerfError, ValueError):
                    continue
            if built:
                yield f"{path.name} {layout} {precision}", precision, built


def _flops_run(cfg, derived) -> float:
    """Model FLOPs per iteration with causal flash attention's skipped tiles left out."""
    flops = float(derived.flops.model_per_iteration)
    if cfg.model.uses_flash:
        tokens = cfg.training.train_batch_size * cfg.model.seq_length
        skipped = 1.0 - float(causal_work_fraction(cfg.model.seq_length))
        flops -= 3 * tokens * derived.flops.attention_scores_per_token * skipped
    return flops


def _check(paths):
    profiles = _profiles()
    seen, refused, worst = set(), set(), {}
    for path in paths:
        for label, precision, built in _variants(path):
            for prof in profiles:
                if prof.facts.gpus_per_node not in built:
                    continue
                cfg, derived = built[prof.facts.gpus_per_node]
                gpu = achievable.gpu_of(prof)
                for way, tf32 in (FP32_MATMULS.items() if precision == "fp32" else [(precision, None)]):
                    try:
                        pred = predict(cfg, derived, prof, tf32=tf32)
                    except NeoxPerfError as exc:
                        line = exc.line()
                        assert "\n" not in line and (
                            (precision == "fp32" and ("no measured" in line or "no TF32 rate" in line))
                            or (precision == "bf16" and not gpu.bf16 and "no bf16" in line)), line
                        refused.add((gpu.name, way))
                        continue
                    ran = way
                    if way == "default":  # the default's pricing, as the prediction says it took it
                        assert pred.fp32_matmuls is not None and not pred.fp32_matmuls.known
                        ran = "tf32" if pred.fp32_matmuls.tf32 else "fp32"
                    rate = gpu.achievable(ran)
                    limit = rate.tflops if rate is not None else gpu.peak_tflops(ran)
                    assert (rate is None) == (gpu.name in NO_ACHIEVABLE_FIGURE)
                    per_gpu = _flops_run(cfg, derived) / pred.estimate.iteration_seconds / cfg.parallel.world_size / 1e12
                    assert per_gpu <= limit * (1 + 1e-9), (
                        f"{label} ({way}) on {prof.name}: {per_gpu:.1f} TFLOP/s per GPU > {gpu.name}'s {limit:g} ({ran})")
                    seen.add((gpu.name, way))
                    worst[(gpu.name, way)] = max(worst.get((gpu.name, way), 0.0), per_gpu / limit)
    return seen, refused, worst


def _assert_covered(seen, refused):
    for g in gpus.GPUS:
        for way in ("fp16", "bf16", *FP32_MATMULS):
            if (way in FP32_MATMULS and g.achievable("fp32") is None or way == "tf32" and g.achievable("tf32") is None
                    or way == "bf16" and not g.bf16):
                assert (g.name, way) in refused and (g.name, way) not in seen, (g.name, way)
            else:
                assert (g.name, way) in seen, (g.name, way)


def test_shipped_examples_never_beat_the_achievable_rate():
    seen, refused, worst = _check(sorted(EXAMPLES.glob("*.yml")))
    _assert_covered(seen, refused)
    # the bound is not vacuous: some prediction comes within reach of it
    assert max(worst.values()) > 0.5


def test_gpt_neox_configs_never_beat_the_achievable_rate(neox_configs):
    paths = sorted(p for p in Path(neox_configs).rglob("*.yml"))
    seen, refused, worst = _check(paths)
    _assert_covered(seen, refused)
    assert max(worst.values()) > 0.5


@pytest.mark.skipif(not NEOX_CONFIGS.is_dir(), reason="../shared/data/gpt-neox-configs is not present")
def test_an_fp32_llama_is_priced_at_fp32_not_from_fp16_samples():
    """NeoX's llama2 configs set neither fp16 nor bf16: they train in fp32. With IEEE fp32
    matmuls (PyTorch's default, no NGC container) at ~19 TFLOP/s on an A100, not 271; with
    TF32 matmuls (NVIDIA's containers) between that and TF32's 134.2."""
    raw = load_files([str(NEOX_CONFIGS / "llama2" / "7B.yml")])
    values = dict(raw.values, train_micro_batch_size_per_gpu=4)
    cfg, _, _ = build(RawConfig(values=values, sources=dict(raw.sources), files=list(raw.files)),
                      WorldRequest(gpus=8, gpus_per_node=8))
    assert cfg.training.precision == "fp32"
    derived = derive(cfg, 32000)
    dgx = load_profile(str(EXAMPLES / "clusters" / "dgx-a100.yml"))
    rates = {}
    for tf32 in (False, True):
        pred = predict(cfg, derived, dgx, tf32=tf32)
        rates[tf32] = derived.flops.model_per_iteration / pred.estimate.iteration_seconds / 8 / 1e12
        assert any("fp32 run priced from fp16 operator samples" in n for n in pred.decomposition.notes)
    assert 5 < rates[False] <= 19.18 < rates[True] <= 134.2
