"""The simulated per-stage instruction order is DeepSpeed's own TrainSchedule, instruction for instruction."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")  # slow import (~2-5 s): once per module

from deepspeed.runtime.pipe import schedule  # noqa: E402
from neox_perf.prediction.timeline import StageCost, simulate_1f1b, stage_instructions  # noqa: E402

_NAMES = {
    schedule.ForwardPass: "forward",
    schedule.BackwardPass: "backward",
    schedule.SendActivation: "send_act",
    schedule.RecvActivation: "recv_act",
    schedule.SendGrad: "send_grad",
    schedule.RecvGrad: "recv_grad",
}


def deepspeed_stream(p, m, s):
    """(kind, micro_batch) per compute/p2p instruction, plus the end-of-batch instructions."""
    sched = schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=s)
    ops, tail = [], []
    prev = -1
    for step, cmds in enumerate(sched):
        mb, _ = sched._step_to_micro_batch(step)
        for cmd in cmds:
            kind = _NAMES.get(type(cmd))
            if kind is None:
                tail.append(type(cmd).__name__)
                continue
            # Sends ship the previous step's buffer; everything else works on this step's.
            used = prev if kind in ("send_act", "send_grad") else mb
            assert cmd.buffer_id == sched._buffer_idx(used)
            ops.append((kind, used))
        prev = mb
    return tuple(ops), tail


GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8, 16) for m in (1, 2, 3, 4, 7, 8, 16, 33)]


@pytest.mark.parametrize("p,m", GRID)
def test_instruction_order_matches_trainschedule(p, m):
    for s in range(p):
        ds_ops, tail = deepspeed_stream(p, m, s)
        assert stage_instructions(p, m, s) == ds_ops, (p, m, s)
        tail = [t for t in tail if t != "LoadMicroBatch"]
        assert tail == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 3), (16, 32)])
def test_simulated_compute_order_is_deepspeed_order(p, m):
    stages = [StageCost(0.5 + 0.1 * s, 1.0 + 0.05 * s, 0.02, 0.03, 0.2) for s in range(p)]
    tl = simulate_1f1b(stages, m)
    for s in range(p):
        ds_compute = [(k, mb) for k, mb in deepspeed_stream(p, m, s)[0] if k in ("forward", "backward")]
        sim = [(e.kind, e.micro_batch) for e in tl.events
               if e.stage == s and e.kind in ("forward", "backward")]
        assert sim == ds_compute
        ds_sends = [(k, mb) for k, mb in deepspeed_stream(p, m, s)[0] if k in ("send_act", "send_grad")]
        sim_sends = [(e.kind, e.micro_batch) for e in tl.events
                     if e.stage == s and e.kind in ("send_act", "send_grad")]
        assert sim_sends == ds_sends
