"""The report's predicted-against-measured components, from rank summaries (no launch)."""
import pytest

from neox_perf.runs.report import _components


def _rank(rank, stage, stages, op_phases):
    return {"rank": rank, "window_iterations": 2,
            "facts": {"stage": stage, "stages": stages, "pipeline": True, "mp": 2},
            "phases": {}, "op_phases": [{"op": op, "phase": ph, "seconds": s}
                                        for op, ph, s in op_phases]}


def test_partition_gathers_are_the_pp_allgather_row():
    # pp 2 x mp 2: stage 0 gathers in backward, stage 1 in forward (2 profiled iterations);
    # the tensor-parallel all-reduces stay in their own row
    ranks = [_rank(0, 0, 2, [("allgather", "backward", 0.006), ("allreduce", "backward", 0.01)]),
             _rank(2, 1, 2, [("allgather", "forward", 0.002), ("allreduce", "forward", 0.01)])]
    rows = {r["name"]: r for r in _components(ranks, {"breakdown": {"pp_allgather": 0.004}}, 3)}
    assert rows["pp_allgather"]["measured"] == pytest.approx(0.003)  # the slower rank, per iteration
    assert rows["pp_allgather"]["predicted"] == 0.004
    assert rows["pp_allgather"]["error"] == pytest.approx(0.004 / 0.003 - 1)
    assert rows["mp_allreduce"]["measured"] == pytest.approx(0.005)
    # without pipeline stages, or without tensor parallelism, nothing is partitioned: no
    # measurement to hold the row against
    one = [_rank(0, 0, 1, [("allgather", "forward", 0.006)])]
    assert {r["name"]: r for r in _components(one, {}, 1)}["pp_allgather"]["measured"] is None
    for r in ranks:
        r["facts"]["mp"] = 1
    assert {r["name"]: r for r in _components(ranks, {}, 3)}["pp_allgather"]["measured"] is None


def test_a_zero_step_is_compared_with_its_all_gather_inside():
    # ZeRO-1, dp 2, no pipeline: DeepSpeed's step ends with the parameter all-gather, so the
    # timed step holds it; the predicted optimizer row adds the predicted all-gather to match
    ranks = [dict(_rank(r, 0, 1, [("allgather", "step", 0.02)]), facts={"stage": 0, "stages": 1})
             for r in (0, 1)]
    plain = {r: {"phases": {"step": 0.018}} for r in (0, 1)}
    bd = {"optimizer": 0.007, "dp_allgather": 0.009}
    rows = {r["name"]: r for r in _components(ranks, {"breakdown": bd}, 2, plain)}
    assert rows["optimizer"]["predicted"] == pytest.approx(0.016)
    assert rows["optimizer"]["measured"] == pytest.approx(0.018)
    assert "ZeRO's all-gather" in rows["optimizer"]["note"]
    assert rows["dp_allgather"]["predicted"] == 0.009 and rows["dp_allgather"]["measured"] == pytest.approx(0.01)
    # without ZeRO the row is the optimizer's alone
    rows = {r["name"]: r for r in _components(ranks, {"breakdown": {"optimizer": 0.007}}, 2, plain)}
    assert rows["optimizer"]["predicted"] == 0.007 and "ZeRO" not in rows["optimizer"]["note"]
