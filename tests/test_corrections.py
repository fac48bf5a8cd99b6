"""The corrections package: one profile's corrections read once (Corrections), and a collective
the engine's own run measured taking that price and no step term -- the run already had what the
step terms correct (corrections/__init__.py, order 5)."""
from dataclasses import replace

import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.derive import derive
from neox_perf.prediction.corrections import Corrections, EngineSection, EngineTerms, StepTerms, of_profile
from neox_perf.prediction.estimate import _Cache
from neox_perf.prediction.operators import CommCall, StageShape, decompose
from neox_perf.predictors import load_profile

ENGINE = {
    "precision": "fp32",
    "dp_allreduce": {"points": [[1e6, 1e-3], [1e7, 5e-3]], "processes": 2},
    "tp_allreduce": {"coef": {"t0": 1e-4, "per_element": 1e-9}, "processes": 2},
}


class _WithEngine:
    def __init__(self, profile, engine):
        self._p = profile
        self.manifest = replace(profile.manifest, engine=EngineSection.parse(engine))

    def __getattr__(self, name):
        return getattr(self._p, name)


def _decomp(write_yaml, precision):
    path = write_yaml("c.yml", """
model_parallel_size: 2
num_layers: 2
hidden_size: 256
num_attention_heads: 4
seq_length: 128
max_position_embeddings: 128
train_micro_batch_size_per_gpu: 2
pipe_parallel_size: 1
""")
    cfg, _, _ = build(load_files([path]), WorldRequest(gpus=2), cluster_gpus_per_node=4)
    d = derive(cfg, 50257)
    shapes = [StageShape(s.index, s.transformer_layers, True, True, s.params_per_rank) for s in d.stages]
    return decompose(cfg, d.padded_vocab, shapes, precision=precision)


def _call(purpose, nodes=1, gpus_per_node=2, elements=2e6):
    kind = {"pp_p2p": "p2p", "dp_allgather": "allgather"}.get(purpose, "allreduce")
    return CommCall(kind, purpose, "fwd", elements, nodes, gpus_per_node, 1.0, "layer")


def test_a_profiles_corrections_are_its_step_terms_engine_terms_and_intervals(write_yaml):
    bundled = load_profile("perlmutter-a100-80gb")
    terms, intervals = of_profile(bundled)
    got = Corrections.of(bundled, _decomp(write_yaml, "fp32"))
    assert got.step == terms and got.intervals == intervals and got.engine is None
    assert not terms.identity and intervals is not None  # the bundled profile carries both
    trial = StepTerms(p2p_s=1e-3)
    assert Corrections.of(bundled, _decomp(write_yaml, "fp32"), trial).step == trial
    calibrated = _WithEngine(bundled, ENGINE)
    assert isinstance(Corrections.of(calibrated, _decomp(write_yaml, "fp32")).engine, EngineTerms)
    # engine terms measured in fp32 say nothing of an fp16 run
    assert Corrections.of(calibrated, _decomp(write_yaml, "fp16")).engine is None


def test_a_collective_is_the_engines_measurement_only_for_the_group_it_measured(write_yaml):
    c = Corrections.of(_WithEngine(load_profile("perlmutter-a100-80gb"), ENGINE), _decomp(write_yaml, "fp32"))
    assert c.measured_collective(_call("mp_allreduce")) == pytest.approx(1e-4 + 1e-9 * 2e6)
    assert c.measured_collective(_call("dp_allreduce")) == pytest.approx(1e-3 + 4e-3 / 9e6 * 1e6)
    for other in (_call("mp_allreduce", nodes=2), _call("mp_allreduce", gpus_per_node=4),
                  _call("dp_allreduce", elements=1e5),  # below the smallest size measured
                  _call("pp_p2p"), _call("tied_allreduce"), _call("dp_allgather")):
        assert c.measured_collective(other) is None, other
    assert Corrections().measured_collective(_call("mp_allreduce")) is None


def test_a_measured_collective_takes_no_step_term_and_a_priced_one_does(write_yaml):
    profile = _WithEngine(load_profile("perlmutter-a100-80gb"), ENGINE)
    engine = Corrections.of(profile, _decomp(write_yaml, "fp32")).engine
    wait = 0.5  # a pipeline handshake no real run has: it shows wherever it applies
    cache = _Cache(profile, engine, StepTerms(p2p_s=wait, dp_fabric_per_doubling=3.0))
    assert cache.time(_call("mp_allreduce")) == pytest.approx(1e-4 + 1e-9 * 2e6)
    assert cache.time(_call("dp_allreduce")) == pytest.approx(1e-3 + 4e-3 / 9e6 * 1e6)
    send = _call("pp_p2p")  # no engine run measures a pipeline send: priced, then the term
    bare = _Cache(profile, engine, StepTerms()).time(send)
    assert cache.time(send) == pytest.approx(bare + wait)


def test_a_layers_backward_residual_takes_its_memory_bound_operators_from_the_estimate(write_yaml):
    # engine.Residual.per_memory (order 6): estimate hands each layer phase its memory-bound
    # operators' seconds; a backward term with per_memory adds exactly that share of them, and
    # nothing to the forward, whose term has none
    from neox_perf.prediction.corrections import COMPUTE_BOUND
    from neox_perf.prediction.estimate import _stage_times
    from neox_perf.prediction.operators import OpCall
    bundled = load_profile("perlmutter-a100-80gb")
    decomp = _decomp(write_yaml, "fp32")
    line = {"seconds": 1e-4, "per_unit": 0.02, "feature": "operators"}
    times = {}
    for per_memory in (0.0, 1.5):
        engine = {**ENGINE, "layer_forward": line, "layer_backward": {**line, "per_memory": per_memory}}
        profile = _WithEngine(bundled, engine)
        c = Corrections.of(profile, decomp, StepTerms())
        cache = _Cache(profile, c.engine, StepTerms())
        times[per_memory] = _stage_times(decomp.stages[0], cache, c.engine)
    work = decomp.stages[0]
    memory = sum(cache.time(x) * x.count for x in work.layer_backward
                 if isinstance(x, OpCall) and x.op not in COMPUTE_BOUND)
    assert 0 < memory < cache.operators(work.layer_backward)
    # the tensor-parallel ratio (none here) would scale it; without one the layer adds 1.5 x memory
    assert times[1.5].layer_backward - times[0.0].layer_backward == pytest.approx(1.5 * memory, rel=1e-9)
    assert times[1.5].layer_forward == times[0.0].layer_forward
