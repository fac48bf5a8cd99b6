"""ZeRO stage 1/2: the engine terms of DeepSpeed's ZeRO optimizer (fitted from the engine
calibration's ZeRO pass) and the decomposition of its data-parallel work."""
import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.derive import derive
from neox_perf.prediction.estimate import estimate
from neox_perf.prediction.operators import MEMORY_OPT_ALLREDUCE_SIZE, StageShape, decompose
from neox_perf.predictors import load_profile
from neox_perf.predictors.fitting.engine_fit import _fit_zero

from test_engine_estimate import ENGINE, _WithEngine

ZERO = {
    "zero_reduce": {"coef": {"t0": 0.01, "per_param": 2e-9}, "stage": 1, "processes": 2},
    "zero_step": {"coef": {"t0": 0.02, "per_param": 4e-9}, "stage": 1, "processes": 2},
    # measured sizes, interpolated: here on the lines 1 ms + 3 ns (8 ns) per element
    "dp_allreduce": {"points": [[1e6, 1e-3 + 3e-3], [5e7, 1e-3 + 0.15]], "processes": 2},
    "dp_allgather": {"points": [[5e5, 1e-3 + 4e-3], [2.5e7, 1e-3 + 0.2]], "processes": 2},
}


def _decomp(write_yaml, zero, gpus=2, gas=2, layers=4, bucket=None):
    zero_opt = f"{{stage: {zero}" + (f", reduce_bucket_size: {bucket}" if bucket else "") + "}"
    path = write_yaml("c.yml", f"""
num_layers: {layers}
hidden_size: 256
num_attention_heads: 4
seq_length: 128
max_position_embeddings: 128
train_micro_batch_size_per_gpu: 2
gradient_accumulation_steps: {gas}
pipe_parallel_size: 1
zero_optimization: {zero_opt}
""")
    cfg, _, _ = build(load_files([path]), WorldRequest(gpus=gpus), cluster_gpus_per_node=2)
    d = derive(cfg, 50257)
    shapes = [StageShape(s.index, s.transformer_layers, True, True, s.params_per_rank) for s in d.stages]
    return decompose(cfg, d.padded_vocab, shapes, precision="fp32")


def _stage(decomp, engine):
    return estimate(decomp, _WithEngine(load_profile("perlmutter-a100-80gb"), engine)).stages[0]


def test_zero_terms_replace_the_optimizer_and_add_to_the_reduction(write_yaml):
    bundled = load_profile("perlmutter-a100-80gb")
    d = _decomp(write_yaml, 1)
    work = d.stages[0]
    params, partition = work.params_per_rank, work.optimizer.feature_dict()["params"]
    assert partition == params / 2
    plain = estimate(d, _WithEngine(bundled, ENGINE)).stages[0]  # no ZeRO terms: as before
    zero = _stage(d, {**ENGINE, **ZERO})
    assert zero.optimizer == pytest.approx(0.02 + 4e-9 * partition)
    assert zero.param_allgather == pytest.approx(1e-3 + 8e-9 * partition)
    assert zero.grad_allreduce == pytest.approx(0.01 + 2e-9 * params + 1e-3 + 3e-9 * params)
    assert plain.optimizer == pytest.approx(estimate(d, bundled).stages[0].optimizer)
    # the plain path's terms stay on the plain path
    assert _stage(_decomp(write_yaml, 0), {**ENGINE, **ZERO}).optimizer == 0.5


def test_zero2_reduces_in_every_micro_batch(write_yaml):
    one, two = _decomp(write_yaml, 1, gas=3), _decomp(write_yaml, 2, gas=3, layers=4)
    assert [c.count for c in two.stages[0].grad_sync] == [3 * c.count for c in one.stages[0].grad_sync]
    params = two.stages[0].params_per_rank
    s1, s2 = _stage(one, {**ENGINE, **ZERO}), _stage(two, {**ENGINE, **ZERO})
    assert s2.grad_allreduce == pytest.approx(3 * s1.grad_allreduce)
    assert s2.grad_allreduce == pytest.approx(3 * (0.01 + 2e-9 * params + 1e-3 + 3e-9 * params))


def test_measured_dp_collectives_only_where_they_were_measured(write_yaml):
    bundled = load_profile("perlmutter-a100-80gb")
    d = _decomp(write_yaml, 1)
    ref = estimate(d, bundled).stages[0]
    small = {**ENGINE, **ZERO, "dp_allreduce": {**ZERO["dp_allreduce"], "points": [[1e12, 1.0], [1e13, 10.0]]},
             "dp_allgather": {**ZERO["dp_allgather"], "processes": 8}}
    s = _stage(d, small)
    zero_reduce = 0.01 + 2e-9 * d.stages[0].params_per_rank
    # below the measured sizes and in another group: the collective predictions
    assert s.grad_allreduce == pytest.approx(ref.grad_allreduce + zero_reduce)
    assert s.param_allgather == pytest.approx(ref.param_allgather)
    # above the largest size measured: at the largest one's cost per element
    big = {**ENGINE, **ZERO, "dp_allgather": {**ZERO["dp_allgather"], "points": [[1e5, 1e-3], [1e6, 0.02]]}}
    partition = d.stages[0].optimizer.feature_dict()["params"]
    assert _stage(d, big).param_allgather == pytest.approx(0.02 * partition / 1e6)


def test_non_zero_gradients_go_in_deepspeeds_fixed_buckets(write_yaml):
    d = _decomp(write_yaml, 0, bucket=1_000_000)
    assert [c.elements for c in d.stages[0].grad_sync] == [d.stages[0].params_per_rank]
    assert d.stages[0].params_per_rank < MEMORY_OPT_ALLREDUCE_SIZE
    z = _decomp(write_yaml, 1, bucket=1_000_000)
    assert {c.elements for c in z.stages[0].grad_sync} >= {1_000_000.0}


def test_fit_zero_recovers_the_terms():
    rows = {}
    for i, params in enumerate((2e6, 6e6, 1.5e7, 4e7)):
        part = params / 2
        rows[str(i)] = {"zero_stage": 1, "processes": 2, "params": params, "partition": part,
                        "reduce": 0.003 + 2e-9 * params, "step": 0.001 + 5e-9 * part,
                        "allreduce_elements": params, "allreduce": 2e-4 + 3e-9 * params,
                        "allgather_elements": part, "allgather": 1e-4 + 9e-9 * part}
    terms, table = _fit_zero(rows)
    assert set(terms) == {"zero_reduce", "zero_step", "dp_allreduce", "dp_allgather"}
    assert terms["zero_reduce"]["coef"]["per_param"] == pytest.approx(2e-9, rel=1e-6)
    assert terms["zero_step"]["coef"] == pytest.approx({"t0": 0.001, "per_param": 5e-9}, rel=1e-6)
    gather = terms["dp_allgather"]
    assert gather["sampled"] == [1e6, 2e7] and gather["processes"] == 2 and gather["rows"] == 4
    assert gather["points"][1] == pytest.approx([3e6, 1e-4 + 9e-9 * 3e6]) and gather["loo_mape"] < 1e-9
    assert [r.op for r in table] == ["engine zero_reduce", "engine zero_step", "engine dp_allreduce",
                                     "engine dp_allgather"]
    # one size measured twice keeps its fastest time, and a larger size is never faster
    from neox_perf.predictors.fitting.engine_fit import _size_curve
    assert _size_curve([(1e6, 0.3), (2e6, 0.1), (1.01e6, 0.2), (3e6, 0.5)]) == [
        [1e6, 0.2], [2e6, 0.2], [3e6, 0.5]]
    # every repeat of the shapes within 10% of one size pooled, the pool's median kept
    from neox_perf.predictors.fitting.engine_fit import _pooled_size_curve
    assert _pooled_size_curve([(1e6, [1.0, 2.0, 3.0]), (1.05e6, [10.0, 20.0]), (2e6, [2.5])]) == [
        [1e6, 3.0], [2e6, 3.0]]
    # one process: no data-parallel collectives to fit
    one = {k: {**r, "processes": 1} for k, r in rows.items()}
    assert set(_fit_zero(one)[0]) == {"zero_reduce", "zero_step"}
    assert _fit_zero({}) == ({}, [])


def test_zero_pass_keeps_the_collectives_median_and_the_own_work_fastest():
    from neox_perf.calibration.engine import zero_statistics
    rows = [{"reduce": r, "step": s, "allreduce": a, "allgather": g}
            for r, s, a, g in ((0.05, 0.2, 0.010, 0.004), (0.04, 0.3, 0.030, 0.009),
                               (0.06, 0.25, 0.018, 0.005), (0.045, 0.22, 0.012, 0.020),
                               (0.07, 0.21, 0.025, 0.006))]
    assert zero_statistics(rows) == {"reduce": 0.04, "step": 0.2, "allreduce": 0.018, "allgather": 0.006,
                                     "allreduce_best": 0.010, "allgather_best": 0.004}
    with pytest.raises(ValueError):
        zero_statistics([])


def test_fit_zero_reports_how_far_the_median_collective_sits_above_the_fastest():
    rows = {str(i): {"zero_stage": 1, "processes": 2, "params": p, "partition": p / 2,
                     "reduce": 0.003 + 2e-9 * p, "step": 0.001 + 5e-9 * p / 2,
                     "allreduce_elements": p, "allreduce": 1.5 * (2e-4 + 3e-9 * p),
                     "allreduce_best": 2e-4 + 3e-9 * p,
                     "allgather_elements": p / 2, "allgather": 1e-4 + 9e-9 * p / 2}
            for i, p in enumerate((2e6, 6e6, 1.5e7))}
    terms, table = _fit_zero(rows)
    assert terms["dp_allreduce"]["median_over_fastest"] == pytest.approx(1.5)
    assert "1.50x the fastest" in table[2].note
    # rows of an engine calibration made before the median was kept: no figure, same curve
    assert "median_over_fastest" not in terms["dp_allgather"]


def test_a_layer_residual_is_interpolated_only_where_that_predicts_left_out_shapes_better():
    import numpy as np

    from neox_perf.predictors.fitting.engine_fit import _ratio_curve, _residual_fit

    def curve(x, m):
        return _ratio_curve(x, m, _residual_fit(x, m - x, m)[1])
    x = np.array([0.002, 0.004, 0.01, 0.02, 0.05, 0.1, 0.3])
    curved = x * (1.0 + 0.5 * (0.002 / x) ** 0.4)  # the ratio falls with size, not on a line
    got = curve(x, curved)
    assert got is not None and got["loo_mape_interior"] < got["loo_mape_interior_linear"]
    assert [p[0] for p in got["ratios"]] == list(x)
    straight = 1e-3 + 1.1 * x  # a fixed cost plus a share of the operators: the line is exact
    assert curve(x, straight) is None
    assert curve(x[:3], curved[:3]) is None  # too few shapes
