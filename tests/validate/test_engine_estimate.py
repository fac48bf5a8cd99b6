"""The estimate adds a profile's engine terms, and only where they were measured."""
import copy
from dataclasses import replace

import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.derive import derive
from neox_perf.prediction.estimate import estimate
from neox_perf.prediction.operators import StageShape, decompose
from neox_perf.prediction.corrections import EngineSection, StepTerms
from neox_perf.predictors import load_profile

ENGINE = {
    "precision": "fp32",
    "layer_forward": {"seconds": 1e-3, "per_unit": 0.5, "feature": "operators"},
    "layer_backward": {"seconds": 0.0, "per_unit": 0.0, "feature": "operators"},
    "other_forward": {"seconds": 0.0, "per_unit": 0.0, "feature": "logits"},
    "other_backward": {"seconds": 0.0, "per_unit": 0.0, "feature": "logits"},
    "optimizer_step": {"coef": {"t0": 0.5, "per_tensor": 0.0, "per_param": 0.0}},
    "grad_flatten": {"coef": {"t0": 0.25, "per_param": 0.0}},
    "grad_accumulate": {"coef": {"per_tensor": 0.0, "per_param": 0.0}},
}


class _WithEngine:
    """The bundled profile, with an engine section added to its manifest."""

    def __init__(self, profile, engine):
        self._p = profile
        self.manifest = replace(profile.manifest, engine=EngineSection.parse(engine))

    def __getattr__(self, name):
        return getattr(self._p, name)


def _decomp(write_yaml, precision, zero=0, mp=1, gpus_per_node=4, dp=1):
    path = write_yaml("c.yml", f"""
model_parallel_size: {mp}
num_layers: 4
hidden_size: 256
num_attention_heads: 4
seq_length: 128
max_position_embeddings: 128
train_micro_batch_size_per_gpu: 2
gradient_accumulation_steps: 2
pipe_parallel_size: 1
zero_optimization: {{stage: {zero}}}
""")
    cfg, _, _ = build(load_files([path]), WorldRequest(gpus=mp * dp), cluster_gpus_per_node=gpus_per_node)
    d = derive(cfg, 50257)
    shapes = [StageShape(s.index, s.transformer_layers, True, True, s.params_per_rank) for s in d.stages]
    return decompose(cfg, d.padded_vocab, shapes, precision=precision)


def test_engine_terms_apply_when_the_precision_matches(write_yaml):
    bundled = load_profile("perlmutter-a100-80gb")
    plain = estimate(_decomp(write_yaml, "fp32"), bundled)
    engine = estimate(_decomp(write_yaml, "fp32"), _WithEngine(bundled, ENGINE))
    p, e = plain.stages[0], engine.stages[0]
    assert e.layer_forward == pytest.approx(1.5 * p.layer_forward + 1e-3, rel=1e-6)
    assert e.layer_backward == pytest.approx(p.layer_backward)
    assert e.optimizer == 0.5 and e.grad_allreduce == pytest.approx(p.grad_allreduce + 0.25)
    assert engine.iteration_seconds > plain.iteration_seconds and e.engine > 0.75
    other = estimate(_decomp(write_yaml, "fp16"), _WithEngine(bundled, ENGINE))
    assert other.iteration_seconds == pytest.approx(estimate(_decomp(write_yaml, "fp16"), bundled).iteration_seconds)


def test_zero_keeps_the_operator_optimizer(write_yaml):
    bundled = load_profile("perlmutter-a100-80gb")
    e = estimate(_decomp(write_yaml, "fp32", zero=1), _WithEngine(bundled, copy.deepcopy(ENGINE))).stages[0]
    p = estimate(_decomp(write_yaml, "fp32", zero=1), bundled).stages[0]
    assert e.optimizer == pytest.approx(p.optimizer) and e.grad_allreduce == pytest.approx(p.grad_allreduce)


def test_precision_reaches_the_decomposition(write_yaml):
    d = _decomp(write_yaml, "fp32")
    assert d.precision == "fp32" and d.dtype_bytes == 4 and d.zero_stage == 0
    assert not d.notes  # an explicit precision is the caller's word, no fp16-sample note
    w = d.stages[0]
    assert w.param_tensors == 4 * 12 + 1 + 1 + 2 and w.logits_elements == 256 * 50304
    assert w.activation_elements == 256 * (256 + 1024)


TP = {"feature": "parts", "processes": 2, "seconds": 0.0, "ratio_range": [1.1, 1.6]}


def test_tensor_parallel_terms_apply_to_the_group_they_were_measured_in(write_yaml):
    """The tensor-parallel pass's ratios scale an mp 2 layer's parts (operators, residual,
    all-reduces) and the head's, on one node; an mp 1 model, or mp 2 across nodes, is as before."""
    bundled = load_profile("perlmutter-a100-80gb")
    tp = {**ENGINE, "tp_layer_forward": {**TP, "per_unit": 0.3},
          "tp_layer_backward": {**TP, "per_unit": 0.2},
          "tp_other_forward": {**TP, "per_unit": 0.5}}
    base, coupled = _WithEngine(bundled, ENGINE), _WithEngine(bundled, tp)
    # without the profile's step terms: its per-micro-batch engine time is not a part
    b, c = (estimate(_decomp(write_yaml, "fp32", mp=2), x, terms=StepTerms()).stages[0]
            for x in (base, coupled))
    assert b.mp_allreduce > 0 and c.mp_allreduce == pytest.approx(b.mp_allreduce)
    assert c.layer_forward == pytest.approx(1.3 * b.layer_forward, rel=1e-9)
    assert c.layer_backward == pytest.approx(1.2 * b.layer_backward, rel=1e-9)
    layers = 4 * c.layer_forward
    assert c.forward - layers == pytest.approx(1.5 * (b.forward - 4 * b.layer_forward), rel=1e-9)
    assert c.backward - 4 * c.layer_backward == pytest.approx(b.backward - 4 * b.layer_backward, rel=1e-9)
    # mp 1: no tensor-parallel all-reduce, nothing added
    one = [estimate(_decomp(write_yaml, "fp32"), x).iteration_seconds for x in (base, coupled)]
    assert one[0] == pytest.approx(one[1], rel=1e-12)
    # mp 2 with one GPU per node: its all-reduces cross nodes, not the group the pass measured
    apart = [estimate(_decomp(write_yaml, "fp32", mp=2, gpus_per_node=1), x).iteration_seconds
             for x in (base, coupled)]
    assert apart[0] == pytest.approx(apart[1], rel=1e-12)


def test_data_parallel_replicas_wait_for_the_slowest_before_their_gradient_all_reduce(write_yaml):
    """dp_arrival: each stage's replicas wait the measured share of the iteration's work on the
    stage before the gradient all-reduce (an event the validate comparison counts with it, and
    the iteration that much longer); dp 1 is as before."""
    from neox_perf.commands.validate import predicted_stage_components
    bundled = load_profile("perlmutter-a100-80gb")
    waits = {**ENGINE, "dp_arrival": {"fraction": 0.04, "processes": 2}}
    for zero in (0, 1):
        d = _decomp(write_yaml, "fp32", zero=zero, dp=2)
        base, waited = (estimate(d, _WithEngine(bundled, e)) for e in (ENGINE, waits))
        b, w = base.stages[0], waited.stages[0]
        work = d.micro_batches * (w.forward + w.backward)
        assert w.dp_wait == pytest.approx(0.04 * work) and b.dp_wait == 0.0
        assert w.grad_allreduce == pytest.approx(b.grad_allreduce) and w.engine == pytest.approx(b.engine + w.dp_wait)
        assert waited.iteration_seconds == pytest.approx(base.iteration_seconds + w.dp_wait)
        assert waited.breakdown["dp_wait"] == pytest.approx(w.dp_wait)
        ev = {e.kind: e for e in waited.timeline.events}
        assert ev["dp_wait"].end == pytest.approx(ev["grad_allreduce"].start)
        got, before = (predicted_stage_components(x)[0]["grad_sync"] for x in (waited, base))
        assert got == pytest.approx(before + w.dp_wait)
    one = [estimate(_decomp(write_yaml, "fp32"), _WithEngine(bundled, e)) for e in (ENGINE, waits)]
    assert one[0].iteration_seconds == pytest.approx(one[1].iteration_seconds, rel=1e-12)
    assert one[1].stages[0].dp_wait == 0.0
