from dataclasses import dataclass

import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.prediction.estimate import estimate
from neox_perf.prediction.operators import StageShape, decompose
from neox_perf.prediction.opspec import collective_wire_bytes
from neox_perf.profile.manifest import Manifest
from neox_perf.profile.sections import Calibration
from neox_perf.profile.values import Coverage

BASE = """
num_layers: 8
hidden_size: 512
num_attention_heads: 8
seq_length: 256
max_position_embeddings: 256
train_micro_batch_size_per_gpu: 2
fp16: {enabled: true}
zero_optimization: {stage: 1}
"""


@dataclass
class Pred:
    seconds: float
    extrapolated: bool = False
    reason: str = ""


@dataclass
class _Facts:
    gpu_name: str
    peak_fp16_tflops: float = 312.0


class RooflineProfile:
    """A deterministic stand-in: 100 TFLOP/s, 1 TB/s, 10 GB/s links, 5 us latency."""

    name = "roofline"
    path = "roofline"
    base = None
    collective_dtype = "fp16"
    manifest = Manifest("roofline")  # no engine or step terms: the plain operator sum
    facts = None  # set per test: the GPU it stands for (the achievable-rate cap and fp32 pricing)

    def __init__(self, flag_op=None, flops=1e14):
        self.facts = _Facts("stand-in (CPU)")
        self.flag_op = flag_op
        self.flops = flops

    def coverage(self, op, phase, features):
        return Coverage("in range", 1.0, "")

    def predict(self, op, phase, features):
        from neox_perf.prediction.opspec import op_bytes, op_flops
        t = max(op_flops(op, phase, features) / self.flops, op_bytes(op, phase, features) / 1e12)
        return Pred(t, op == self.flag_op, "d above the sampled range" if op == self.flag_op else "")

    def predict_collective(self, kind, elements, nodes, gpus_per_node):
        ranks = nodes * gpus_per_node
        return Pred(float(collective_wire_bytes(kind, elements, max(ranks, 2))) / 1e10 + 5e-6)


def run(write_yaml, extra, gpus, stages=1):
    cfg, _, _ = build(load_files([write_yaml("c.yml", BASE + extra)]), WorldRequest(gpus=gpus, gpus_per_node=4))
    per = 8 // stages
    shapes = [StageShape(i, per, i == 0, i == stages - 1, 1_000_000) for i in range(stages)]
    return estimate(decompose(cfg, 50304, shapes), RooflineProfile())


def test_single_stage_is_serial_sum(write_yaml):
    est = run(write_yaml, "gradient_accumulation_steps: 3\n", gpus=1)
    st = est.stages[0]
    assert est.iteration_seconds == pytest.approx(3 * (st.forward + st.backward) + st.optimizer)
    assert st.grad_allreduce == 0 and st.param_allgather == 0


def test_recompute_adds_a_layer_forward_per_layer(write_yaml):
    plain = run(write_yaml, "", gpus=1).stages[0]
    ckpt = run(write_yaml, "checkpoint_activations: true\n", gpus=1).stages[0]
    assert ckpt.forward == pytest.approx(plain.forward)
    assert ckpt.backward - plain.backward == pytest.approx(8 * plain.layer_forward)


def test_more_micro_batches_amortise_the_bubble(write_yaml):
    few = run(write_yaml, "pipe_parallel_size: 4\ngradient_accumulation_steps: 4\n", gpus=4, stages=4)
    many = run(write_yaml, "pipe_parallel_size: 4\ngradient_accumulation_steps: 16\n", gpus=4, stages=4)
    assert many.iteration_seconds > few.iteration_seconds
    assert many.iteration_seconds / 16 < few.iteration_seconds / 4
    assert few.breakdown["bubble"] > 0


def test_data_parallel_adds_gradient_sync(write_yaml):
    one = run(write_yaml, "", gpus=1)
    four = run(write_yaml, "", gpus=4)
    assert four.breakdown["dp_allreduce"] > 0 and one.breakdown["dp_allreduce"] == 0
    assert four.iteration_seconds > one.iteration_seconds


def test_extrapolation_flags_reach_the_estimate(write_yaml):
    cfg, _, _ = build(load_files([write_yaml("c.yml", BASE)]), WorldRequest(gpus=1))
    est = estimate(decompose(cfg, 50304, [StageShape(0, 8, True, True, 10)]), RooflineProfile("linear3"))
    assert [f.what for f in est.flags] == ["linear3 bwd", "linear3 fwd"]


def test_the_fp32_note_names_fp16_samples_only_when_they_are(write_yaml):
    """An fp32 config on fp16 GPU samples is priced at the GPU's fp32 rate and says so; a
    profile whose own samples ran in fp32 (a CPU calibration) has nothing to say; one that can
    price neither (16-bit samples, a device the GPU table does not know) refuses in one line."""
    from neox_perf.derive import derive
    from neox_perf.errors import NeoxPerfError
    from neox_perf.prediction.operators import FP32_FROM_FP16
    from neox_perf.prediction.predict import predict
    path = write_yaml("c.yml", BASE.replace("fp16: {enabled: true}", "fp16: {enabled: false}"))
    cfg, _, _ = build(load_files([path]), WorldRequest(gpus=1, gpus_per_node=1))
    derived = derive(cfg, 50257)
    gpu = RooflineProfile()
    gpu.facts = _Facts("NVIDIA A100-SXM4-80GB")
    # priced as IEEE fp32 (what a run without TF32 has; the TF32 side is tests/predictors/test_tf32.py)
    notes = predict(cfg, derived, gpu, tf32=False, tf32_source="the test").decomposition.notes
    assert FP32_FROM_FP16 not in notes
    assert any("fp32 run priced from fp16 operator samples at A100-SXM4-80GB" in n
               and "matmuls as IEEE fp32: the test" in n for n in notes), notes
    cpu = RooflineProfile()
    cpu.facts = _Facts("AMD EPYC 7763 64-Core Processor (CPU)")
    cpu.manifest = Manifest("cpu", calibration=Calibration(dtype="fp32", device="cpu"))
    assert not any("fp32" in n for n in predict(cfg, derived, cpu).decomposition.notes)
    unknown = RooflineProfile()
    unknown.facts = _Facts("Some Accelerator 9000")
    with pytest.raises(NeoxPerfError) as err:
        predict(cfg, derived, unknown)
    assert "no fp32 rate" in err.value.line() and "\n" not in err.value.line()


def _limited(write_yaml, precision_yaml, facts, flops=1e14):
    from neox_perf.derive import derive
    from neox_perf.prediction.predict import predict
    cfg, _, _ = build(load_files([write_yaml("c.yml", BASE.replace("fp16: {enabled: true}", precision_yaml))]),
                      WorldRequest(gpus=1, gpus_per_node=1))
    prof = RooflineProfile(flops=flops)
    prof.facts = facts
    # fp32 priced as IEEE fp32, as a run without TF32 computes it (TF32: tests/predictors/test_tf32.py)
    return predict(cfg, derive(cfg, 50257), prof, tf32=False, tf32_source="the test")


def test_no_operator_call_beats_the_gpus_achievable_rate(write_yaml):
    """Samples at 1000 TFLOP/s on an A100 80GB PCIe: every GEMM is held to its measured 252.9
    TFLOP/s and flagged as capped; at 100 TFLOP/s nothing is."""
    slow = _limited(write_yaml, "fp16: {enabled: true}", _Facts("NVIDIA A100 80GB PCIe"))
    assert not [f for f in slow.estimate.flags if f.kind == "capped"]
    fast = _limited(write_yaml, "fp16: {enabled: true}", _Facts("NVIDIA A100 80GB PCIe"), flops=1e15)
    capped = {f.what: f for f in fast.estimate.flags if f.kind == "capped"}
    assert {"linear_final fwd", "linear_final bwd"} <= set(capped)  # the rest are bytes-bound here
    assert "252.9 TFLOP/s" in capped["linear_final fwd"].reason
    st = fast.decomposition.stages[0]
    m = fast.decomposition.micro_batches
    for call in st.layer_forward:
        if getattr(call, "flops", 0) > 1e9:  # the GEMMs and attention matmuls
            floor = call.flops * call.count * st.transformer_layers * m / 252.9e12
            assert fast.estimate.operators[f"{call.op} {call.phase}"] >= floor * (1 - 1e-9)
            assert slow.estimate.operators[f"{call.op} {call.phase}"] >= floor * (1 - 1e-9)


def test_fp32_is_priced_at_the_gpus_fp32_rate(write_yaml):
    """The same fp16 samples priced for an fp32 run on an A100 80GB PCIe by the additive
    roofline of its achievable rates (252.9 -> 18.88 TFLOP/s) and doubled bytes: this small
    GEMM (intensity ~230 FLOP/B) ~9x slower, a norm twice (its bytes only)."""
    from neox_perf.prediction.opspec import op_bytes, op_flops
    fp16 = _limited(write_yaml, "fp16: {enabled: true}", _Facts("NVIDIA A100 80GB PCIe"))
    fp32 = _limited(write_yaml, "fp16: {enabled: false}", _Facts("NVIDIA A100 80GB PCIe"))
    gemm = fp32.estimate.operators["linear3 fwd"] / fp16.estimate.operators["linear3 fwd"]
    f = {"m": 512, "k": 512, "n": 2048}  # tokens 2 x 256, hidden 512, MLP 4 x 512
    F, w = op_flops("linear3", "fwd", f), 1935e9
    want = (F / 18.88e12 + op_bytes("linear3", "fwd", f, 4) / w) / (F / 252.9e12 + op_bytes("linear3", "fwd", f, 2) / w)
    assert gemm == pytest.approx(want, rel=1e-6) and gemm > 5
    norm = fp32.estimate.operators["layernorm fwd"] / fp16.estimate.operators["layernorm fwd"]
    f = {"tokens": 512, "d": 512}  # the vector units' rate (19.5) in both: only the bytes double
    F, v = op_flops("layernorm", "fwd", f), 19.5e12
    want = (F / v + op_bytes("layernorm", "fwd", f, 4) / w) / (F / v + op_bytes("layernorm", "fwd", f, 2) / w)
    assert norm == pytest.approx(want, rel=1e-6) and 1.5 < norm <= 2



def test_partition_gathers_are_spent_by_the_receiving_stage(write_yaml):
    """pp 2 x mp 2: stage 1 all-gathers its input inside each forward, stage 0 its output and
    the received gradient inside each backward; the breakdown and the operator table name
    them, and taking them out of the decomposition takes exactly that time off."""
    from dataclasses import replace

    from neox_perf.prediction.operators import CommCall
    cfg, _, _ = build(load_files([write_yaml("c.yml", BASE + "pipe_parallel_size: 2\nmodel_parallel_size: 2\n"
                                            "gradient_accumulation_steps: 4\n")]),
                      WorldRequest(gpus=4, gpus_per_node=4))
    shapes = [StageShape(i, 4, i == 0, i == 1, 1_000_000) for i in range(2)]
    decomp = decompose(cfg, 50304, shapes)
    est = estimate(decomp, RooflineProfile())
    g = RooflineProfile().predict_collective("allgather", 2 * 256 * 512 / 2, 1, 2).seconds
    first, last = est.stages
    assert (first.pp_allgather, last.pp_allgather) == (pytest.approx(2 * g), pytest.approx(g))
    assert est.breakdown["pp_allgather"] == pytest.approx(4 * est.stages[est.timeline.critical_stage].pp_allgather)
    crit = est.timeline.critical_stage
    assert est.operators[f"pp_allgather {'bwd' if crit == 0 else 'fwd'}"] == pytest.approx(
        4 * est.stages[crit].pp_allgather)

    def strip(calls):
        return tuple(c for c in calls if not (isinstance(c, CommCall) and c.purpose == "pp_allgather"))
    bare = estimate(replace(decomp, stages=tuple(replace(s, forward=strip(s.forward), backward=strip(s.backward))
                                                 for s in decomp.stages)), RooflineProfile())
    assert last.forward - bare.stages[1].forward == pytest.approx(g)
    assert first.backward - bare.stages[0].backward == pytest.approx(2 * g)
    assert (first.forward, last.backward) == (bare.stages[0].forward, bare.stages[1].backward)
    assert est.iteration_seconds > bare.iteration_seconds


def test_a_stage_time_below_zero_is_one_line_naming_the_profile(write_yaml):
    """Whatever makes a stage's time impossible (here a profile whose pipeline send predicts a
    negative time, as a line fitted to large messages can below them), check and the hook say
    so in one line naming the profile, the stage and the fix, not an internal error."""
    from neox_perf.errors import ProfileError

    class Negative(RooflineProfile):
        def predict_collective(self, kind, elements, nodes, gpus_per_node):
            got = super().predict_collective(kind, elements, nodes, gpus_per_node)
            return Pred(-1e-4, False) if kind == "p2p" else got

    cfg, _, _ = build(load_files([write_yaml("c.yml", BASE + "pipe_parallel_size: 2\n")]),
                      WorldRequest(gpus=2, gpus_per_node=4))
    shapes = [StageShape(0, 4, True, False, 1_000_000), StageShape(1, 4, False, True, 1_000_000)]
    with pytest.raises(ProfileError) as err:
        estimate(decompose(cfg, 50304, shapes), Negative())
    line = err.value.line()
    assert "\n" not in line and line.startswith("roofline: ") and "stage 0" in line
    assert "send_activation" in line and "fix: " in line


def test_a_flags_reasons_stay_when_another_shape_of_the_call_is_capped_again():
    """Two shapes of one op/phase capped for the same reason, an extrapolation between them:
    the flag keeps both reasons (the second cap used to replace the text with its own)."""
    import types
    from neox_perf.prediction.estimate import _Cache
    from neox_perf.prediction.operators import OpCall
    terms = types.SimpleNamespace(operator=lambda op, s: s)
    limits = types.SimpleNamespace(rescaled=lambda call, s: s, capped=lambda call, s: (s, "capped at 271 TFLOP/s"))
    cache = _Cache(profile=None, terms=terms, limits=limits)
    call = OpCall("linear1", "fwd", (("k", 8), ("m", 8), ("n", 8)), 1.0, "layer", 1e9, 1e6)
    cache._operator_seconds(call, 1.0)
    cache._note("linear1 fwd", types.SimpleNamespace(extrapolated=True, reason="past the largest sample"))
    cache._operator_seconds(call, 1.0)
    assert cache.flags["linear1 fwd"] == "past the largest sample; capped at 271 TFLOP/s"
    assert "linear1 fwd" not in cache.capped_only  # extrapolated too
