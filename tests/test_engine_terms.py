"""The manifest's engine section, parsed once into frozen dataclasses and written back as it was."""
from types import SimpleNamespace

import pytest

from neox_perf.prediction.corrections import EngineSection, EngineTerms, EngineTermsError
from neox_perf.profile.manifest import Manifest

SECTION = {
    "precision": "fp32", "source": "/x/s.engine.json", "shapes": ["a", "b"],
    "layer_forward": {"seconds": 1e-3, "per_unit": 0.5, "feature": "operators", "rows": 3},
    "other_backward": {"seconds": -2e-3, "per_unit": 1e-9, "feature": "logits", "rows": 3},
    "optimizer_step": {"coef": {"t0": 1e-3, "per_tensor": 1e-5, "per_param": 1e-9}, "rows": 3},
    "grad_accumulate": {"coef": {"per_tensor": 2e-6, "per_param": 3e-10}, "rows": 3},
    "zero_step": {"coef": {"t0": 4e-3, "per_param": 2e-9}, "stage": 1, "processes": 2},
    "dp_allreduce": {"points": [[1e6, 1e-3], [1e7, 5e-3]], "processes": 2, "rows": 4},
    "tp_allreduce": {"coef": {"t0": 1e-4, "per_element": 1e-9}, "processes": 2, "rows": 5},
}


def _terms(zero=0, m=4, section=SECTION):
    decomp = SimpleNamespace(precision="fp32", micro_batches=m, zero_stage=zero)
    # as the manifest parses it: an empty section is none
    manifest = Manifest("p", engine=EngineSection.parse(section) if section else None)
    return EngineTerms.of(SimpleNamespace(name="p", manifest=manifest), decomp)


def test_parsed_once_and_written_back_unchanged():
    sec = EngineSection.parse(SECTION)
    assert sec.to_dict() == SECTION
    assert sec.linear("optimizer_step").per_param == 1e-9 and sec.curves["dp_allreduce"].processes == 2
    with pytest.raises(Exception):
        sec.precision = "fp16"  # frozen


def test_terms_apply_as_the_manifest_says():
    t = _terms()
    assert t.layer("forward", 0.01) == 1e-3 + 0.5 * 0.01
    assert t.layer("backward", 0.01) == 0.0  # no such term: nothing added
    assert t.other("backward", 0.001, 1e6) == pytest.approx(-1e-3)  # never below -operators
    assert t.other("backward", 0.0005, 1e6) == -0.0005
    assert t.optimizer(1e6, 10) == 1e-3 + 1e-5 * 10 + 1e-9 * 1e6
    assert t.accumulate(1e6, 10) == (2e-6 * 10 + 3e-10 * 1e6) * 3 / 4
    zero = _terms(zero=1)
    assert zero.optimizer(1e6, 10, partition=5e5) == 4e-3 + 2e-9 * 5e5
    call = SimpleNamespace(purpose="dp_allreduce", nodes=1, gpus_per_node=2, elements=5.5e6)
    assert zero.dp_collective(call) == pytest.approx(3e-3)  # halfway between the points
    assert zero.dp_collective(SimpleNamespace(**{**call.__dict__, "gpus_per_node": 4})) is None
    tp = SimpleNamespace(purpose="mp_allreduce", nodes=1, gpus_per_node=2, elements=1e6)
    assert t.tp_allreduce(tp) == 1e-4 + 1e-9 * 1e6


def test_another_precision_or_no_section_applies_nothing():
    assert _terms(section={**SECTION, "precision": "fp16"}) is None
    assert _terms(section={}) is None


def test_a_malformed_term_is_one_line_naming_the_key():
    with pytest.raises(EngineTermsError) as err:
        EngineSection.parse({**SECTION, "optimizer_step": {"coef": {"t0": "fast"}}}, "p: manifest engine")
    line = err.value.line()
    assert "\n" not in line and "p: manifest engine.optimizer_step" in line and "fix:" in line


def test_an_old_term_is_kept_through_the_dataclass():
    old = EngineSection.parse(SECTION)
    refit = EngineSection.parse({k: v for k, v in SECTION.items() if k != "tp_allreduce"})
    kept = refit.with_terms_of(old, "tp_allreduce")
    assert kept.to_dict() == SECTION and "tp_allreduce" not in refit.to_dict()


def test_a_layer_residual_interpolates_between_its_measured_shapes():
    ratios = [[0.002, 1.5], [0.02, 1.15], [0.2, 1.01]]
    term = {"seconds": 1e-3, "per_unit": 0.05, "feature": "operators", "ratios": ratios}
    sec = EngineSection.parse({"precision": "fp32", "layer_forward": term})
    res = sec.residuals["layer_forward"]
    assert res.at(0.02) == pytest.approx(0.15 * 0.02)  # at a measured shape: its own ratio
    mid = (0.002 * 0.02) ** 0.5  # halfway in log operators
    assert res.at(mid) == pytest.approx((1.5 + 1.15) / 2 * mid - mid)
    assert res.at(1.0) == pytest.approx(1e-3 + 0.05)  # outside the measured range: the line
    assert sec.to_dict()["layer_forward"] == term
    with pytest.raises(EngineTermsError):
        EngineSection.parse({"precision": "fp32", "layer_forward": {**term, "ratios": [[0.2, 1.0], [0.02, 1.1]]}})


# The layer_backward term `neox-perf calibrate` fitted on this project's 2-core CPU (the
# `ident` profile benchmarks/outputs_identical.py builds): +135.8% of the operators - 1.79 ms,
# a straight line fitted on layers of 3.3 to 338 ms of operators. A 2-stage model of 4 tiny
# layers has 0.52 ms of operators per layer backward, where that line gives -0.57 ms.
IDENT_BACKWARD = {"seconds": -0.001785941691737131, "per_unit": 1.3578297062707199,
                  "feature": "operators", "rows": 10, "sampled": [0.003341335814915093, 0.33774825866893865]}


def test_a_residual_below_its_measured_shapes_keeps_the_lowest_ratio_it_was_measured_at():
    t = _terms(section={"precision": "fp32", "layer_backward": IDENT_BACKWARD})
    lo, hi = IDENT_BACKWARD["sampled"]
    line = IDENT_BACKWARD["seconds"] + IDENT_BACKWARD["per_unit"] * 0.52e-3
    assert 0.52e-3 + line < 0  # the line alone: a negative layer backward
    # a profile fitted before the measured ratios were recorded: the line's own ratio at the
    # ends of its sampled range (1.82x at the smallest shape) is the lowest it has evidence for
    floor = 1 + IDENT_BACKWARD["per_unit"] + IDENT_BACKWARD["seconds"] / lo
    assert floor == pytest.approx(1.8234, abs=1e-3)
    assert 0.52e-3 + t.layer("backward", 0.52e-3) == pytest.approx(floor * 0.52e-3)
    for x in (lo, 0.01, hi, 1.0):  # inside the range and above it the line is unchanged
        assert t.layer("backward", x) == pytest.approx(IDENT_BACKWARD["seconds"] + IDENT_BACKWARD["per_unit"] * x)


def test_a_fitted_ratio_range_is_the_floor_and_is_written_back():
    term = {**IDENT_BACKWARD, "ratio_range": [1.5, 2.4]}
    sec = EngineSection.parse({"precision": "fp32", "layer_backward": term})
    assert sec.to_dict()["layer_backward"] == term
    t = _terms(section={"precision": "fp32", "layer_backward": term})
    assert 0.52e-3 + t.layer("backward", 0.52e-3) == pytest.approx(1.5 * 0.52e-3)
    for bad in ([0.0, 2.0], [2.0, 1.5], [1.5], "wide"):
        with pytest.raises(EngineTermsError, match="layer_backward"):
            EngineSection.parse({"precision": "fp32", "layer_backward": {**term, "ratio_range": bad}})


def test_a_residual_without_a_measured_range_never_takes_a_phase_below_zero():
    t = _terms(section={"precision": "fp32", "layer_forward": {"seconds": -1e-3, "per_unit": 0.1}})
    assert t.layer("forward", 2e-4) == -2e-4
    assert t.layer("forward", 0.0) == 0.0  # no layer here: nothing, not minus the fixed part
    assert t.layer("forward", 0.1) == pytest.approx(-1e-3 + 0.1 * 0.1)


def test_a_tensor_parallel_term_applies_to_one_node_groups_of_its_size_only():
    term = {"seconds": 0.0, "per_unit": 0.25, "feature": "parts", "processes": 2,
            "ratio_range": [0.9, 1.5], "rows": 10}
    t = _terms(section={**SECTION, "tp_layer_forward": term})
    assert EngineSection.parse({**SECTION, "tp_layer_forward": term}).to_dict()["tp_layer_forward"] == term

    def calls(*groups):
        return [SimpleNamespace(purpose="mp_allreduce", nodes=n, gpus_per_node=g) for n, g in groups]
    assert t.tensor_parallel("layer", "forward", 0.1, calls((1, 2), (1, 2))) == pytest.approx(0.025)
    assert t.tensor_parallel("layer", "forward", 0.1, calls((1, 4))) == 0.0  # another group size
    assert t.tensor_parallel("layer", "forward", 0.1, calls((2, 1))) == 0.0  # across nodes
    assert t.tensor_parallel("layer", "forward", 0.1, []) == 0.0  # no tensor parallelism
    assert t.tensor_parallel("layer", "backward", 0.1, calls((1, 2))) == 0.0  # no such term
    assert t.tensor_parallel("layer", "forward", 0.0, calls((1, 2))) == 0.0  # nothing to scale


def test_the_replicas_wait_is_a_share_of_their_work_bounded_past_the_measured_group():
    """dp_arrival: a replica waits at the gradient all-reduce for the slowest, the measured share
    of the work since they met; smaller groups wait less (the slowest of fewer is nearer their
    mean), larger ones are held at the measured group's share; no data-parallel group, none."""
    from neox_perf.prediction.corrections.engine import expected_max_normal
    section = {**SECTION, "dp_arrival": {"fraction": 0.03, "processes": 4, "repeats": 40}}
    assert EngineSection.parse(section).to_dict() == section  # written back as it was
    t = _terms(section=section)

    def calls(dp, nodes=1):
        return (SimpleNamespace(purpose="dp_allreduce", nodes=nodes, gpus_per_node=dp // nodes),)
    assert t.dp_wait(calls(4), 2.0) == pytest.approx(0.06)
    assert t.dp_wait(calls(2), 2.0) == pytest.approx(0.06 * expected_max_normal(2) / expected_max_normal(4))
    assert 0 < t.dp_wait(calls(2), 2.0) < 0.06 * 0.6  # 0.564 / 1.029 of it
    assert t.dp_wait(calls(64, nodes=8), 2.0) == pytest.approx(0.06)  # not past the measured 4
    assert t.dp_wait((), 2.0) == 0.0  # dp 1: no gradient all-reduce
    assert _terms().dp_wait(calls(4), 2.0) == 0.0  # not measured: nothing added
    assert [round(expected_max_normal(n), 3) for n in (1, 2, 4, 8)] == [0.0, 0.564, 1.029, 1.424]
    with pytest.raises(EngineTermsError):
        EngineSection.parse({**SECTION, "dp_arrival": {"fraction": 0.03, "processes": 1}})
    with pytest.raises(EngineTermsError):
        EngineSection.parse({**SECTION, "dp_arrival": {"fraction": -0.01, "processes": 2}})


# A layer's backward residual that also grows with its memory-bound operators (engine_fit's
# SPLIT_PHASES): written back as read, added only on the line, and one line when unreadable.
SPLIT_BACKWARD = {"seconds": 2e-4, "per_unit": 0.02, "per_memory": 1.5, "feature": "operators",
                  "rows": 10, "ratio_range": [1.01, 1.3]}


def test_a_backward_residual_adds_its_share_of_the_memory_bound_operators():
    sec = EngineSection.parse({"precision": "fp32", "layer_backward": SPLIT_BACKWARD})
    assert sec.to_dict()["layer_backward"] == SPLIT_BACKWARD
    t = _terms(section={"precision": "fp32", "layer_backward": SPLIT_BACKWARD})
    # 20 ms of operators, 4 ms of them memory-bound: the line plus 1.5 x 4 ms
    assert t.layer("backward", 0.020, 0.004) == pytest.approx(2e-4 + 0.02 * 0.020 + 1.5 * 0.004)
    # the same operators, all compute-bound: the line alone
    assert t.layer("backward", 0.020) == pytest.approx(2e-4 + 0.02 * 0.020)
    # an older section without the key reads as 0 and is written back without it
    plain = {k: v for k, v in SPLIT_BACKWARD.items() if k != "per_memory"}
    assert EngineSection.parse({"precision": "fp32", "layer_backward": plain}).to_dict()["layer_backward"] == plain
    with pytest.raises(EngineTermsError) as err:
        EngineSection.parse({"precision": "fp32", "layer_backward": {**SPLIT_BACKWARD, "per_memory": "nan"}},
                            "p: manifest engine")
    assert "\n" not in err.value.line() and "layer_backward" in err.value.line()


def test_the_memory_share_does_not_move_a_residual_read_off_its_measured_ratios():
    ratios = [[0.002, 1.5], [0.02, 1.15], [0.2, 1.01]]
    term = {**SPLIT_BACKWARD, "ratios": ratios}
    res = EngineSection.parse({"precision": "fp32", "layer_backward": term}).residuals["layer_backward"]
    assert res.at(0.02, 0.01) == pytest.approx(0.15 * 0.02)  # inside the measured shapes: their ratio
    assert res.at(1.0, 0.5) == pytest.approx(2e-4 + 0.02 + 1.5 * 0.5)  # outside: the line
