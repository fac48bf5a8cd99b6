"""The 1F1B pipeline timeline: reduction to the paper's Eq. 7, heterogeneous stages, p2p, sync."""
from __future__ import annotations

import math
import random

import pytest

from neox_perf.prediction.timeline import (
    Event,
    StageCost,
    Timeline,
    eq7_seconds,
    simulate_1f1b,
    stage_instructions,
)

F, B = 1.0, 2.0


def equal_stages(p, **kw):
    base = dict(forward=F, backward=B, send_activation=0.0, send_gradient=0.0, grad_allreduce=0.7,
                optimizer=0.3, param_allgather=0.2)
    base.update(kw)
    return [StageCost(**base) for _ in range(p)]


def random_stages(rng, p, p2p=True, tied=False):
    out = []
    for s in range(p):
        out.append(StageCost(
            forward=rng.uniform(0.2, 2.0),
            backward=rng.uniform(0.4, 4.0),
            send_activation=rng.uniform(0.0, 0.3) if p2p else 0.0,
            send_gradient=rng.uniform(0.0, 0.3) if p2p else 0.0,
            grad_allreduce=rng.uniform(0.0, 3.0),
            tied_allreduce=rng.uniform(0.1, 1.0) if tied and s in (0, p - 1) else 0.0,
            optimizer=rng.uniform(0.0, 0.5),
            param_allgather=rng.uniform(0.0, 0.5),
        ))
    return out


# --- Eq. 7 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_equal_stages_reduce_to_eq7(p, m):
    stages = equal_stages(p)
    tl = simulate_1f1b(stages, m)
    expected = (m - 1 + p) * (F + B) + 0.7 + 0.3 + 0.2
    assert eq7_seconds(stages, m) == pytest.approx(expected, abs=1e-12)
    assert tl.iteration_seconds == pytest.approx(eq7_seconds(stages, m), abs=1e-9)
    assert tl.components["eq7_seconds"] == pytest.approx(tl.iteration_seconds, abs=1e-9)
    assert tl.critical_stage == 0  # First_Stage_Gradient_Synchronization is the exposed one


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_unequal_allreduce_is_max_over_stages_not_first_stage(p, m):
    # Stage s ends its last backward s*B before stage 0 and the optimizer waits for every stage
    # (global norm / overflow all-reduce), so the exposed sync is max_s(AR_s - s*B), which is
    # Eq. 7's AR_0 exactly when AR_s <= AR_0 + s*B.
    rng = random.Random(p * 100 + m)
    ar = [rng.uniform(0.0, 3.0 * B) for _ in range(p)]
    upd = [rng.uniform(0.0, 1.0) for _ in range(p)]
    stages = [StageCost(F, B, 0.0, 0.0, ar[s], optimizer=upd[s]) for s in range(p)]
    tl = simulate_1f1b(stages, m)
    expected = (m - 1 + p) * (F + B) + max(ar[s] - s * B for s in range(p)) + max(upd)
    assert tl.iteration_seconds == pytest.approx(expected, abs=1e-9)
    if all(ar[s] <= ar[0] + s * B for s in range(p)):
        assert tl.iteration_seconds == pytest.approx(eq7_seconds(stages, m), abs=1e-9)
    else:
        assert tl.iteration_seconds > eq7_seconds(stages, m)


def test_hidden_later_allreduce_matches_eq7():
    # Paper Fig. 2: later stages' sync hides behind earlier stages' remaining backward.
    p, m = 4, 8
    stages = [StageCost(F, B, 0.0, 0.0, 1.0 + s * B) for s in range(p)]
    assert simulate_1f1b(stages, m).iteration_seconds == pytest.approx(eq7_seconds(stages, m), abs=1e-9)


def test_eq7_upper_bounds_heterogeneous_stages_without_p2p():
    # Eq. 7 replaces every stage by the slowest one; with no p2p and equal sync it can only over-estimate.
    rng = random.Random(7)
    for _ in range(200):
        p, m = rng.randint(1, 8), rng.randint(1, 24)
        stages = [StageCost(rng.uniform(0.2, 2), rng.uniform(0.4, 4), 0.0, 0.0, 0.9,
                            optimizer=rng.uniform(0, 0.5)) for _ in range(p)]
        assert simulate_1f1b(stages, m).iteration_seconds <= eq7_seconds(stages, m) + 1e-9


# --- heterogeneous stages, p2p, bubbles --------------------------------------------------------

@pytest.mark.parametrize("slow", [0, 1, 2, 3])
def test_slowest_stage_sets_the_steady_state_period(slow):
    stages = equal_stages(4, grad_allreduce=0.0, optimizer=0.0, param_allgather=0.0)
    stages[slow] = StageCost(1.5, 3.5, 0.0, 0.0, 0.0)
    t = [simulate_1f1b(stages, m).iteration_seconds for m in range(12, 20)]
    for a, b in zip(t, t[1:]):
        assert b - a == pytest.approx(1.5 + 3.5, abs=1e-9)
    assert t[0] >= 12 * (1.5 + 3.5)


def test_p2p_cost_increases_iteration_time():
    base = simulate_1f1b(equal_stages(4), 8).iteration_seconds
    prev = base
    for c in (0.01, 0.1, 0.5):
        tl = simulate_1f1b(equal_stages(4, send_activation=c, send_gradient=c), 8)
        assert tl.iteration_seconds > prev
        assert tl.components["pp_p2p_seconds"] > 0
        prev = tl.iteration_seconds


def test_rendezvous_blocks_the_sender_and_is_never_faster_than_buffered_sends():
    rng = random.Random(3)
    for _ in range(100):
        p, m = rng.randint(2, 6), rng.randint(1, 12)
        stages = random_stages(rng, p)
        rdv = simulate_1f1b(stages, m)
        eager = simulate_1f1b(stages, m, p2p_rendezvous=False)
        assert rdv.iteration_seconds >= eager.iteration_seconds - 1e-9
        assert not any(e.kind == "send_wait" for e in eager.events)
    # Stage 1 has the gradient of micro-batch 0 ready, but stage 0 posts RecvGrad only after its
    # second forward (warm-up), so the blocking send holds stage 1 until then.
    stages = [StageCost(3.0, 3.0, 0.1, 0.1, 0.0), StageCost(1.0, 1.0, 0.1, 0.1, 0.0)]
    tl = simulate_1f1b(stages, 4)
    f1 = next(e for e in tl.events if e.stage == 0 and e.kind == "forward" and e.micro_batch == 1)
    wait = next(e for e in tl.events if e.stage == 1 and e.kind == "send_wait")
    assert wait.micro_batch == 0 and wait.end == pytest.approx(f1.end)
    sg = next(e for e in tl.events if e.stage == 1 and e.kind == "send_grad" and e.micro_batch == 0)
    assert sg.start == pytest.approx(f1.end)


def test_zero_cost_p2p_rendezvous_equals_buffered():
    rng = random.Random(11)
    for _ in range(100):
        p, m = rng.randint(1, 8), rng.randint(1, 16)
        stages = random_stages(rng, p, p2p=False)
        a = simulate_1f1b(stages, m).iteration_seconds
        b = simulate_1f1b(stages, m, p2p_rendezvous=False).iteration_seconds
        assert a == pytest.approx(b, abs=1e-9)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_bubble_of_equal_stages(p, m):
    tl = simulate_1f1b(equal_stages(p), m)
    assert tl.components["bubble_seconds"] == pytest.approx((p - 1) * (F + B), abs=1e-9)
    # Stage s finishes s backward passes earlier than stage 0, so it idles that much less.
    for s in range(p):
        assert tl.bubble[s] == pytest.approx((p - 1) * (F + B) - s * B, abs=1e-9)
    assert tl.components["pipeline_seconds"] == pytest.approx((m - 1 + p) * (F + B), abs=1e-9)


def test_stage_with_zero_work_still_waits():
    stages = [StageCost(1.0, 2.0, 0.0, 0.0, 0.0), StageCost(0.0, 0.0, 0.0, 0.0, 0.0),
              StageCost(1.0, 2.0, 0.0, 0.0, 0.0)]
    tl = simulate_1f1b(stages, 4)
    mid = [e for e in tl.events if e.stage == 1 and e.kind == "forward"]
    assert [e.micro_batch for e in mid] == [0, 1, 2, 3]
    assert mid[0].start == pytest.approx(1.0)  # after stage 0's forward of micro-batch 0
    assert tl.busy[1] == 0.0
    assert tl.idle[1] == pytest.approx(tl.iteration_seconds)
    # It behaves like a 2-stage pipeline of the other two.
    two = simulate_1f1b([stages[0], stages[2]], 4)
    assert tl.iteration_seconds == pytest.approx(two.iteration_seconds, abs=1e-9)


def test_single_micro_batch_is_fully_serial():
    rng = random.Random(5)
    for p in (1, 2, 3, 5):
        stages = random_stages(rng, p)
        stages = [StageCost(c.forward, c.backward, c.send_activation, c.send_gradient, 1.0,
                            optimizer=c.optimizer, param_allgather=c.param_allgather) for c in stages]
        tl = simulate_1f1b(stages, 1)
        chain = sum(c.forward + c.backward for c in stages)
        chain += sum(c.send_activation for c in stages[:-1]) + sum(c.send_gradient for c in stages[1:])
        expected = chain + 1.0 + max(c.optimizer + c.param_allgather for c in stages)
        assert tl.iteration_seconds == pytest.approx(expected, abs=1e-9)


def test_single_stage_is_gradient_accumulation():
    c = StageCost(1.0, 2.0, 5.0, 5.0, 0.4, optimizer=0.1, param_allgather=0.2)
    tl = simulate_1f1b([c], 6)
    assert tl.iteration_seconds == pytest.approx(6 * 3.0 + 0.4 + 0.3)
    assert tl.components["bubble_seconds"] == pytest.approx(0.0)
    assert tl.components["pp_p2p_seconds"] == 0.0


# --- end of batch: tied reduce, sync before the optimizer ---------------------------------------

def test_tied_reduce_pulls_last_stage_allreduce_out_from_under_the_backward():
    p, m, tied = 4, 8, 0.5
    ar = [1.0, 1.0, 1.0, 1.5]
    stages = [StageCost(F, B, 0.0, 0.0, ar[s], tied_allreduce=tied if s in (0, p - 1) else 0.0,
                        optimizer=0.2) for s in range(p)]
    tl = simulate_1f1b(stages, m)
    t_pipe = (m - 1 + p) * (F + B)
    # The last stage waits for stage 0 at ReduceTiedGrads, so its bigger all-reduce is exposed.
    assert tl.iteration_seconds == pytest.approx(t_pipe + tied + 1.5 + 0.2, abs=1e-9)
    assert tl.critical_stage == p - 1
    assert tl.components["tied_allreduce_exposed"] == pytest.approx(tied)
    assert tl.components["dp_allreduce_exposed"] == pytest.approx(1.5)
    waits = [e for e in tl.events if e.kind == "tied_wait"]
    assert [e.stage for e in waits] == [p - 1]
    assert waits[0].end - waits[0].start == pytest.approx((p - 1) * B)


def test_optimizer_waits_for_every_stage_unless_told_otherwise():
    stages = [StageCost(F, B, 0.0, 0.0, 0.5, optimizer=2.0), StageCost(F, B, 0.0, 0.0, 0.5, optimizer=0.1)]
    synced = simulate_1f1b(stages, 4)
    free = simulate_1f1b(stages, 4, optimizer_sync=False)
    t_pipe = 5 * (F + B)
    assert synced.iteration_seconds == pytest.approx(t_pipe + 0.5 + 2.0)
    assert any(e.kind == "sync_wait" and e.stage == 1 for e in synced.events)
    # Without the barrier stage 1 updates early, but stage 0 still bounds the iteration here.
    assert free.iteration_seconds == pytest.approx(t_pipe + 0.5 + 2.0)
    stages = [StageCost(F, B, 0.0, 0.0, 0.5, optimizer=0.1), StageCost(F, B, 0.0, 0.0, 0.5, optimizer=2.5)]
    assert simulate_1f1b(stages, 4).iteration_seconds == pytest.approx(t_pipe + 0.5 + 2.5)
    assert simulate_1f1b(stages, 4, optimizer_sync=False).iteration_seconds == pytest.approx(
        t_pipe - B + 0.5 + 2.5)


# --- structure and bookkeeping -----------------------------------------------------------------

def test_components_add_up_and_events_are_consistent():
    rng = random.Random(2024)
    for _ in range(150):
        p, m = rng.randint(1, 8), rng.randint(1, 20)
        stages = random_stages(rng, p, tied=rng.random() < 0.5)
        for rdv in (True, False):
            tl = simulate_1f1b(stages, m, p2p_rendezvous=rdv)
            _check_timeline(tl, stages, m, rdv)


def _check_timeline(tl: Timeline, stages, m, rdv):
    c = tl.components
    p = len(stages)
    total = c["pipeline_seconds"] + c["tied_allreduce_exposed"] + c["dp_allreduce_exposed"] + c["update_seconds"]
    assert total == pytest.approx(tl.iteration_seconds, abs=1e-9)
    for k in ("tied_allreduce_exposed", "dp_allreduce_exposed", "update_seconds", "bubble_seconds"):
        assert c[k] >= -1e-9, k
    cs = tl.critical_stage
    assert tl.stage_ready[cs] == pytest.approx(
        c["critical_compute_seconds"] + c["pp_p2p_seconds"] + c["bubble_seconds"], abs=1e-9)
    assert max(tl.stage_ready) <= c["pipeline_seconds"] + 1e-9
    assert c["stage_forward_max"] == max(s.forward for s in stages)
    assert c["stage_backward_max"] == max(s.backward for s in stages)
    for s in range(p):
        assert tl.busy[s] + tl.idle[s] == pytest.approx(tl.iteration_seconds)
        assert tl.idle[s] >= -1e-9 and tl.bubble[s] >= -1e-9
    by_key = {}
    per_stage = {s: [] for s in range(p)}
    for e in tl.events:
        assert isinstance(e, Event) and e.end >= e.start >= 0.0
        per_stage[e.stage].append(e)
        by_key[(e.stage, e.kind, e.micro_batch)] = e
    for s, evs in per_stage.items():
        for a, b in zip(evs, evs[1:]):  # one stream per stage: in order, never overlapping
            assert b.start >= a.end - 1e-9, (s, a, b)
        assert [e.micro_batch for e in evs if e.kind == "forward"] == list(range(m))
        assert [e.micro_batch for e in evs if e.kind == "backward"] == list(range(m))
    for s in range(p):
        for i in range(m):
            f = by_key[(s, "forward", i)]
            b = by_key[(s, "backward", i)]
            assert b.start >= f.end - 1e-9
            if s > 0:
                up = by_key[(s - 1, "forward", i)]
                assert f.start >= up.end + stages[s - 1].send_activation - 1e-9
            if s < p - 1:
                down = by_key[(s + 1, "backward", i)]
                assert b.start >= down.end + stages[s + 1].send_gradient - 1e-9
    assert tl.iteration_seconds >= max(tl.grad_sync_end) - 1e-9


def test_instruction_stream_shape():
    for p in (1, 2, 5):
        for m in (1, 3, 9):
            for s in range(p):
                ops = stage_instructions(p, m, s)
                kinds = [k for k, _ in ops]
                assert kinds.count("forward") == kinds.count("backward") == m
                assert kinds.count("send_act") == kinds.count("recv_grad") == (m if s < p - 1 else 0)
                assert kinds.count("recv_act") == kinds.count("send_grad") == (m if s > 0 else 0)
                # 1F1B: warm-up forwards = stages still downstream, capped by m.
                first_bwd = kinds.index("backward")
                assert kinds[:first_bwd].count("forward") == min(p - s, m)
    with pytest.raises(ValueError):
        stage_instructions(2, 2, 2)


@pytest.mark.parametrize("bad", [
    dict(stages=[], m=1),
    dict(stages=[StageCost(1, 1, 0, 0, 0)], m=0),
    dict(stages=[StageCost(1, 1, 0, 0, 0)], m=2.0),
    dict(stages=[StageCost(-1, 1, 0, 0, 0)], m=2),
    dict(stages=[StageCost(1, math.nan, 0, 0, 0)], m=2),
    dict(stages=[StageCost(1, 1, 0, 0, math.inf)], m=2),
])
def test_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        simulate_1f1b(bad["stages"], bad["m"])


def test_timeline_is_frozen():
    tl = simulate_1f1b(equal_stages(2), 2)
    with pytest.raises(Exception):
        tl.iteration_seconds = 0.0
    with pytest.raises(TypeError):
        tl.components["bubble_seconds"] = 0.0


def test_p16_m128_runs_every_micro_batch():
    # its speed is benchmarks/unit_speed.py's
    stages = [StageCost(0.05 + 0.001 * s, 0.1, 0.002, 0.002, 0.3, optimizer=0.01, param_allgather=0.02)
              for s in range(16)]
    stages[0] = StageCost(0.06, 0.12, 0.002, 0.0, 0.3, tied_allreduce=0.05, optimizer=0.01)
    tl = simulate_1f1b(stages, 128)
    assert tl.iteration_seconds > 128 * 0.165


@pytest.mark.parametrize("rendezvous", [True, False])
def test_a_timeline_without_events_is_the_same_timeline(rendezvous):
    """events=False (the planner's) leaves the events out and nothing else: every field equal,
    whether its stream is simulated afresh or comes from one simulated with events, and a
    stream simulated without events is never handed to a caller that wants them."""
    from neox_perf.prediction import timeline as T
    rng = random.Random(7)
    for _ in range(30):
        p, m = rng.randint(1, 9), rng.randint(1, 40)
        stages = random_stages(rng, p, p2p=rng.random() < 0.8, tied=rng.random() < 0.5)
        T._STREAMS.clear()
        bare = simulate_1f1b(stages, m, p2p_rendezvous=rendezvous, events=False)
        full = simulate_1f1b(stages, m, p2p_rendezvous=rendezvous)
        again = simulate_1f1b(stages, m, p2p_rendezvous=rendezvous, events=False)
        assert bare.events == () == again.events and len(full.events) >= 2 * p * m
        for field in ("iteration_seconds", "busy", "idle", "bubble", "stage_ready", "grad_sync_end",
                      "critical_stage"):
            assert getattr(bare, field) == getattr(full, field) == getattr(again, field), field
        assert dict(bare.components) == dict(full.components) == dict(again.components)


def test_the_step_by_step_stream_is_the_instruction_stream_to_the_last_bit():
    """_lockstep_streams (the planner's and every events=False caller's) against the
    instruction-by-instruction simulation it replaces there: the same clocks, last backward
    ends and sent seconds, compared with ==, on depths 1-33, one micro-batch to many, equal
    stages (ties everywhere), free sends and random ones."""
    from neox_perf.prediction import timeline as T
    rng = random.Random(11)
    shapes = [(1, 1), (1, 5), (2, 1), (33, 1), (33, 70), (32, 1024)]
    shapes += [(rng.randint(1, 33), rng.randint(1, 80)) for _ in range(400)]
    for p, m in shapes:
        kind = rng.choice(("equal", "random", "free sends"))
        def cost(lo, hi, tie):
            return [tie if kind == "equal" else rng.uniform(lo, hi) for _ in range(p)]
        fwd, bwd = cost(0.1, 2.0, 1.0), cost(0.2, 4.0, 2.0)
        act, grad = ([0.0] * p, [0.0] * p) if kind == "free sends" else (cost(0.0, 0.3, 0.05), cost(0.0, 0.3, 0.05))
        slow = T._streams(p, m, fwd, bwd, act, grad, True, record=False)
        fast = T._lockstep_streams(p, m, fwd, bwd, act, grad)
        assert fast == slow, (p, m, kind)
