"""trace_map on traces recorded once with torch.profiler on CPU (tests/hooks/traces/)."""
import pytest

from hook_helpers import load_trace
from neox_perf.hooks.trace_map import (Dims, Event, Groups, MapContext, Unmapped, infer_dims,
                                       linear_name, map_events)


def ops(result):
    """{(op, phase, features dict as tuple): calls}"""
    return {(op, ph, feats): agg.calls for (op, ph, feats, _), agg in result.ops.items()}


def f(**kw):
    return tuple(sorted(kw.items()))


@pytest.fixture(scope="module")
def workload():
    events, ctx = load_trace("workload_layer.json")
    return map_events(events, ctx)


def test_every_neox_layer_operator_is_found_with_its_shape(workload):
    # 1 layer, h16, 2 heads (hd 8), s8, b1 (tokens 8), vocab 128; 2 micro-batches
    got = ops(workload)
    expected = {
        "embedding": f(d=16, tokens=8, vocab=128), "layernorm": f(d=16, tokens=8),
        "linear1": f(k=16, m=8, n=48), "qk": f(batch=2, head_dim=8, l=8),
        "fillmask": f(batch=2, l=8), "softmax": f(batch=2, l=8),
        "av": f(batch=2, head_dim=8, l=8), "linear2": f(k=16, m=8, n=16),
        "linear3": f(k=16, m=8, n=64), "gelu": f(tokens=8, width=64),
        "linear4": f(k=64, m=8, n=16), "res_add": f(d=16, tokens=8),
        "linear_final": f(k=16, m=8, n=128), "cross_entropy": f(tokens=8, vocab=128),
    }
    per_mb = {"layernorm": 3, "res_add": 2}  # two per layer (+ the final norm)
    for op, feats in expected.items():
        n = 2 * per_mb.get(op, 1)
        assert got.get((op, "fwd", feats)) == n, (op, feats, got)
        assert got.get((op, "bwd", feats)) == n, (op, feats, got)
    assert got[("optimizer", "step", f(params=7408))] == 1


def test_backward_is_linked_through_sequence_numbers(workload):
    agg = {k[:2]: a for k, a in workload.ops.items()}
    # A linear's backward is its own nodes (Mm/Addmm, T, View), never its forward's time.
    for op in ("linear1", "linear3", "qk", "fillmask"):
        assert agg[(op, "bwd")].seconds > 0
        assert agg[(op, "bwd")].seconds != agg[(op, "fwd")].seconds
    # masked_fill_ on a view: CopySlices wraps MaskedFillBackward0 and is charged to fillmask
    assert "backward: torch::autograd::CopySlices" not in workload.unmapped


def test_phase_ranges_and_what_is_left(workload):
    assert set(workload.phases) == {"forward", "backward", "step"}
    assert workload.phases["forward"].calls == 2
    assert workload.op_phases[("linear1", "forward")] > 0
    assert workload.op_phases[("linear1", "backward")] > 0
    # Python-level rotary embedding has no aten op of its own: reported, not guessed.
    assert any(n.startswith("backward: SliceBackward") for n in workload.unmapped)
    assert all(u["reason"] for u in workload.unmapped.values())


def test_sdpa_and_activation_recompute():
    events, ctx = load_trace("sdpa_recompute.json")
    r = map_events(events, ctx)
    got = ops(r)
    flash = f(b=2, causal=1, head_dim=8, heads=2, l=8)
    # micro-batch 1 plain; micro-batch 2 checkpointed: forward without grad, rerun in backward
    assert got[("flash_attention", "fwd", flash)] == 3
    assert got[("flash_attention", "bwd", flash)] == 2
    assert got[("linear3", "fwd", f(k=16, m=16, n=64))] == 3
    assert got[("linear3", "bwd", f(k=16, m=16, n=64))] == 2
    assert got[("embedding", "fwd", f(d=16, tokens=16, vocab=32))] == 2
    assert got[("cross_entropy", "bwd", f(tokens=16, vocab=32))] == 2
    assert any("recompute" in n for n in r.notes)


def test_gloo_collectives_on_worker_threads():
    events, ctx = load_trace("gloo_collectives.json")
    r = map_events(events, ctx)
    got = ops(r)
    assert got[("allreduce", "comm", f(elements=1000, gpus_per_node=2, nodes=1))] == 1
    assert got[("allgather", "comm", f(elements=10, gpus_per_node=2, nodes=1))] == 1
    assert got[("p2p", "comm", f(elements=256, gpus_per_node=2, nodes=1))] == 1
    assert "group is unknown" in r.unmapped["gloo:all_reduce"]["reason"]  # the scalar norm
    assert "not in the decomposition" in r.unmapped["gloo:broadcast"]["reason"]
    assert r.iterations == 1


def test_linear_names_follow_the_layer_widths():
    d = Dims(hidden=64, qkv=96, ffn_out=128, ffn_in=128, vocab=256, hidden_local=32)  # mp=2
    assert linear_name(8, 64, 96, d) == "linear1"
    assert linear_name(8, 32, 64, d) == "linear2"
    assert linear_name(8, 64, 128, d) == "linear3"
    assert linear_name(8, 128, 64, d) == "linear4"
    assert linear_name(8, 64, 256, d) == "linear_final"
    with pytest.raises(Unmapped, match="matches no layer width"):
        linear_name(8, 64, 10, d)
    with pytest.raises(Unmapped, match="no model widths"):
        linear_name(8, 64, 96, Dims())


def test_widths_inferred_from_layernorm_without_a_config():
    events, _ = load_trace("workload_layer.json")
    d = infer_dims(events)
    assert (d.hidden, d.qkv, d.ffn_out, d.source) == (16, 48, 64, "trace")
    r = map_events(events, MapContext(dims=Dims()))
    assert not any(k[0].startswith("linear") for k in r.ops)
    assert any("no model widths" in u["reason"] for u in r.unmapped.values())


def _ev(i, name, start, dur, parent=None, shapes=None, seq=-1, thread=1):
    return Event(i, name, parent, thread, start, dur, shapes=shapes or [], seq=seq)


def test_unmapped_op_is_reported_whole_and_mapped_children_win():
    ctx = MapContext(dims=Dims(hidden=4, qkv=12, ffn_out=16, ffn_in=16, vocab=32, hidden_local=4))
    events = [
        _ev(0, "neox_perf::forward", 0, 100),
        _ev(1, "aten::einsum", 1, 10, 0, [[2, 4], [4, 16]], seq=1),  # matmul-free: unmapped
        _ev(2, "aten::bmm", 2, 5, 1, [[3, 2, 4], [3, 4, 2]], seq=2),  # ... unless a child maps
        _ev(3, "aten::sort", 20, 10, 0, [[8]], seq=3),
        _ev(4, "aten::sort_stable", 21, 8, 3, [[8]]),
    ]
    r = map_events(events, ctx)
    assert ops(r) == {("qk", "fwd", f(batch=3, head_dim=4, l=2)): 1}
    assert set(r.unmapped) == {"aten::sort"}  # not its child sort_stable


def test_events_round_trip_through_json():
    events, _ = load_trace("sdpa_recompute.json")
    again = [Event.from_dict(e.to_dict()) for e in events]
    assert [e.to_dict() for e in again] == [e.to_dict() for e in events]


def test_fused_kernels_called_through_autograd_functions():
    events = [_ev(0, "neox_perf::forward", 0, 100),
              _ev(1, "ScaledUpperTriangMaskedSoftmax", 1, 10, 0, [[16, 32, 32], []], seq=5),
              _ev(2, "aten::exp", 2, 5, 1, [[16, 32, 32]]),
              _ev(3, "FusedLayerNormAffineFunction", 20, 10, 0, [[32, 2, 64], [64], [64]], seq=6)]
    got = ops(map_events(events, MapContext()))
    assert got == {("fused_softmax", "fwd", f(batch=16, l=32)): 1,
                   ("layernorm", "fwd", f(d=64, tokens=64)): 1}


def test_collective_groups_follow_the_phase_and_the_layout():
    from neox_perf.hooks.trace_map import collective_group
    g = Groups(dp=4, mp=2, stages=2, local_world=8)  # 16 ranks on 2 nodes of 8
    assert collective_group("allreduce", "forward", g) == (1, 2)  # tensor parallel: adjacent
    assert collective_group("allreduce", "reduce_grads", g) == (1, 4)  # dp: stride 2, 4 per node
    assert collective_group("p2p", "send_activations", g) == (2, 1)  # stages are 8 ranks apart
    assert collective_group("allreduce", "reduce_tied_grads", g) == (2, 1)
    assert collective_group("allreduce", "optimizer_step", g) is None  # a norm: group unknown
    plain = Groups(dp=2, mp=1, stages=1, local_world=2)
    assert collective_group("allreduce", "backward", plain) == (1, 2)  # ZeRO/DDP hooks
