"""No prediction implies more FLOP/s per GPU than the GPU can sustain (issue #24, section 4).

Every shipped config (neox_perf/examples/*.yml, and GPT-NeoX's own configs under
../shared/data/gpt-neox-configs when present) x every GPU in the table x fp16 / bf16 / fp32,
predicted through `predict.predict` (the path check, plan, validate and the hook share):
model FLOPs per iteration / predicted seconds / GPUs <= the GPU's achievable dense rate for
that precision (gpus.Rate; the data-sheet peak for the one row without a measured figure,
L40S, named below so that fallback cannot spread unseen). A GPU the table cannot price fp32
on refuses the fp32 run in one line instead.

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
from neox_perf.opspec import causal_work_fraction
from neox_perf.predict import predict
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
                try:
                    pred = predict(cfg, derived, prof)
                except NeoxPerfError as exc:
                    line = exc.line()
                    assert precision == "fp32" and "\n" not in line and "no measured" in line, line
                    refused.add((gpu.name, precision))
                    continue
                rate = gpu.achievable(precision)
                limit = rate.tflops if rate is not None else gpu.peak_tflops(precision)
                assert (rate is None) == (gpu.name in NO_ACHIEVABLE_FIGURE)
                per_gpu = _flops_run(cfg, derived) / pred.estimate.iteration_seconds / cfg.parallel.world_size / 1e12
                assert per_gpu <= limit * (1 + 1e-9), (
                    f"{label} on {prof.name}: {per_gpu:.1f} TFLOP/s per GPU > {gpu.name}'s {limit:g} ({precision})")
                seen.add((gpu.name, precision))
                worst[(gpu.name, precision)] = max(worst.get((gpu.name, precision), 0.0), per_gpu / limit)
    return seen, refused, worst


def _assert_covered(seen, refused):
    for g in gpus.GPUS:
        for precision in PRECISIONS:
            if precision == "fp32" and g.achievable("fp32") is None:
                assert (g.name, precision) in refused and (g.name, precision) not in seen, g.name
            else:
                assert (g.name, precision) in seen, (g.name, precision)


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
    """NeoX's llama2 configs set neither fp16 nor bf16: their matmuls run in IEEE fp32 (NeoX
    never enables TF32, PyTorch leaves it off), at ~19 TFLOP/s on an A100, not 271."""
    raw = load_files([str(NEOX_CONFIGS / "llama2" / "7B.yml")])
    values = dict(raw.values, train_micro_batch_size_per_gpu=4)
    cfg, _, _ = build(RawConfig(values=values, sources=dict(raw.sources), files=list(raw.files)),
                      WorldRequest(gpus=8, gpus_per_node=8))
    assert cfg.training.precision == "fp32"
    derived = derive(cfg, 32000)
    dgx = load_profile(str(EXAMPLES / "clusters" / "dgx-a100.yml"))
    pred = predict(cfg, derived, dgx)
    per_gpu = derived.flops.model_per_iteration / pred.estimate.iteration_seconds / 8 / 1e12
    assert 5 < per_gpu <= 19.18
    assert any("fp32 run priced from fp16 operator samples" in n for n in pred.decomposition.notes)
