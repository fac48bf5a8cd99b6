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
    # Python-level rotary embedding has no op of its own: its slices join the operators
    # next to them, listed as glue with the operator they joined, never silently.
    assert any(n.startswith("backward: SliceBackward") for n in workload.glue)
    assert all(g["ops"] and g["seconds"] > 0 for g in workload.glue.values())
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
    # the scalar gradient-norm all-reduce of the optimizer step: no group of its own in the
    # decomposition, so it joins the step's collective next to it (listed as glue)
    assert "gloo:all_reduce" not in r.unmapped
    assert set(r.glue["gloo:all_reduce"]["ops"]) == {"allgather fwd"}
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
    # the unnamed sort joins the operator before it in the same range, whole (not its child)
    assert r.glue["aten::sort"]["ops"] == pytest.approx({"qk fwd": 10e-6})
    assert "aten::sort_stable" not in r.glue and not r.unmapped
    # with no named operator in its range it stays unmapped, reported whole
    r = map_events([events[0], events[3], events[4]], ctx)
    assert set(r.unmapped) == {"aten::sort"} and not r.glue and not r.ops


def test_host_gaps_join_the_next_operator_but_not_collective_waits():
    ctx = MapContext(dims=Dims(hidden=4, qkv=12, ffn_out=16, ffn_in=16, vocab=32, hidden_local=4))
    events = [
        _ev(0, "neox_perf::forward", 0, 100),
        _ev(1, "aten::linear", 10, 20, 0, [[2, 4], [12, 4], [12]], seq=1),  # gap 0..10 before
        _ev(2, "c10d::allreduce_", 40, 1, 0),  # gap 30..40; then the main thread waits 41..90
        _ev(3, "gloo:all_reduce", 45, 40, None, [[2, 4]], thread=7),  # covers 45..85
        _ev(4, "aten::gelu", 90, 5, 0, [[2, 16]], seq=2),
    ]
    r = map_events(events, MapContext(dims=ctx.dims, groups=Groups(mp=2)))
    gap = r.glue["host time between operators"]
    # 0..10 -> linear1, 30..40 -> the all-reduce issued next; 41..90 minus the 40 us the
    # collective covers -> gelu; 95..100 -> the last operator (gelu)
    assert gap["ops"] == pytest.approx({"linear1 fwd": 10e-6, "allreduce fwd": 10e-6,
                                        "gelu fwd": 14e-6})
    assert gap["seconds"] == pytest.approx(34e-6)
    # the same window on a GPU: operators are kernel time, host gaps overlap them
    r = map_events(events, MapContext(dims=ctx.dims, groups=Groups(mp=2), device="cuda"))
    assert "host time between operators" not in r.glue


def test_an_operator_waiting_inside_on_a_collective_keeps_only_its_own_time():
    # NeoX's vocab-parallel cross-entropy all-reduces inside its forward: the rank waits in
    # the operator while gloo's thread carries the collective, which is mapped on its own.
    d = Dims(hidden=4, qkv=12, ffn_out=16, ffn_in=16, vocab=32, hidden_local=4)
    events = [
        _ev(0, "neox_perf::forward", 10, 60),  # no host gaps around the operator
        _ev(1, "_VocabParallelCrossEntropy", 10, 60, 0, [[2, 3, 16], [2, 3]], seq=1),
        _ev(2, "c10d::allreduce_", 20, 1, 1),
        _ev(3, "gloo:all_reduce", 22, 30, None, [[2, 3]], thread=7),  # 22..52, inside 10..70
    ]
    for device, own in (("cpu", 30e-6), ("cuda", None)):
        r = map_events(events, MapContext(dims=d, groups=Groups(mp=2), device=device))
        ce = {k[:2]: a.seconds for k, a in r.ops.items()}[("cross_entropy", "fwd")]
        if own is not None:
            assert ce == pytest.approx(own)  # 60 us less the 30 the collective covers
            assert r.op_phases[("allreduce", "forward")] == pytest.approx(30e-6)
            mapped = sum(s for (_, ph), s in r.op_phases.items() if ph == "forward")
            assert mapped <= r.phases["forward"].seconds
        else:
            assert ce == 0.0  # a GPU operator is its kernels' time: no host wait to remove


def test_neox_skip_bias_add_joins_its_linear():
    d = Dims(hidden=4, qkv=12, ffn_out=16, ffn_in=16, vocab=32, hidden_local=4)
    events = [
        _ev(0, "neox_perf::forward", 0, 100),
        _ev(1, "aten::linear", 1, 10, 0, [[2, 3, 4], [4, 4]], seq=1),  # linear2, no bias
        _ev(2, "aten::expand_as", 12, 1, 0, [[4], [2, 3, 4]], seq=2),  # bias.expand_as(residual)
        _ev(3, "aten::add", 14, 3, 0, [[2, 3, 4], [2, 3, 4], []], seq=3),  # x + bias
        _ev(4, "aten::add", 18, 3, 0, [[2, 3, 4], [2, 3, 4], []], seq=4),  # residual + out
        _ev(5, "aten::linear", 30, 10, 0, [[2, 3, 4], [4, 4]], seq=5),  # no expand: a residual
        _ev(6, "aten::add", 41, 3, 0, [[2, 3, 4], [2, 3, 4], []], seq=6),
    ]
    r = map_events(events, MapContext(dims=d))
    got = ops(r)
    assert got[("res_add", "fwd", f(d=4, tokens=6))] == 2
    assert got[("linear2", "fwd", f(k=4, m=6, n=4))] == 2
    assert "bias add of a RowParallelLinear (skip_bias_add)" in r.glue


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


def test_pipeline_partition_gathers_map_to_the_tensor_parallel_group():
    # DeepSpeed's PipelineEngine at pp 2 x mp 2 (events as a hooked run of the workload records
    # them): ForwardPass on stage 1 gathers the partitioned activation, BackwardPass on stage 0
    # its own output and the received gradient; each rank's chunk, 2048 elements, on gloo's
    # worker threads. They are the decomposition's pp_allgather calls: all-gathers over the
    # tensor-parallel group, inside forward / backward, nothing unmapped.
    chunk = f(elements=2048, gpus_per_node=2, nodes=1)
    last = [_ev(0, "neox_perf::forward", 0, 500),
            _ev(1, "c10d::_allgather_base_", 10, 5, 0, [[4096], [2048], [], [], []], seq=1),
            _ev(2, "gloo:all_gather", 12, 200, None, [[2048]], thread=5)]
    r = map_events(last, MapContext(groups=Groups(mp=2, stages=2, stage=1, local_world=4)))
    assert ops(r) == {("allgather", "comm", chunk): 1}
    # the gather's own time, plus the range's host time it is the only operator to join
    assert r.op_phases[("allgather", "forward")] >= 200e-6
    assert not r.unmapped
    first = [_ev(0, "neox_perf::backward", 0, 900),
             _ev(1, "c10d::_allgather_base_", 10, 5, 0, [[4096], [2048], [], [], []], seq=1),
             _ev(2, "gloo:all_gather", 12, 300, None, [[2048]], thread=7),
             _ev(3, "c10d::_allgather_base_", 400, 5, 0, [[4096], [2048], [], [], []], seq=2),
             _ev(4, "gloo:all_gather", 402, 100, None, [[2048]], thread=8)]
    r = map_events(first, MapContext(groups=Groups(mp=2, stages=2, stage=0, local_world=4)))
    assert ops(r) == {("allgather", "comm", chunk): 2}
    assert r.op_phases[("allgather", "backward")] >= 400e-6
    assert not r.unmapped
    # with grad_partitioned off the engine gathers its output in RecvGrad instead
    from neox_perf.hooks.trace_map import collective_group
    g = Groups(mp=2, stages=2, local_world=4)
    assert collective_group("allgather", "recv_grads", g) == (1, 2)
    assert collective_group("allgather", "recv_grads", Groups(mp=1, stages=2)) is None


# ---- GPT-NeoX's own train.py (tests/hooks/traces/make_neox_traces.py) -------------------------

def _share(r, pipeline):
    """What the report calls the mapped share: operator time in forward/backward, and a
    pipeline's gradient reduction, over the time of those ranges. These traces have dp = 1:
    DeepSpeed's flatten, one-rank all-reduce and copy-back there map to the decomposition's
    gradient-reduction term, never to the unmapped list."""
    from neox_perf.hooks.trace_map import GRAD_REDUCE_TERM
    phases = ("forward", "backward") + (("reduce_grads",) if pipeline else ())
    total = sum(r.phases[p].seconds for p in phases if p in r.phases)
    # a plain engine reduces inside backward, so its reduction counts there too (as the report)
    mapped = sum(s for (op, ph), s in r.op_phases.items()
                 if ph in ("forward", "backward", "reduce_grads"))
    assert not any("data parallelism 1" in u["reason"] for u in r.unmapped.values())
    if "reduce_grads" in r.phases:
        assert r.op_phases.get((GRAD_REDUCE_TERM, "reduce_grads"), 0.0) > 0
    return mapped / total


def test_neox_pipeline_rotary_layer_maps_whole():
    events, ctx = load_trace("neox_pp1_rotary.json")
    r = map_events(events, ctx)
    got = ops(r)
    # 1 layer, h32, 2 heads (hd 16), s16, b1, 2 micro-batches; CharLevelTokenizer 512
    for op, feats in {"linear1": f(k=32, m=16, n=96), "linear2": f(k=32, m=16, n=32),
                      "linear3": f(k=32, m=16, n=128), "linear4": f(k=128, m=16, n=32),
                      "qk": f(batch=2, head_dim=16, l=16), "av": f(batch=2, head_dim=16, l=16),
                      "fillmask": f(batch=2, l=16), "softmax": f(batch=2, l=16),
                      "gelu": f(tokens=16, width=128), "linear_final": f(k=32, m=16, n=512),
                      "cross_entropy": f(tokens=16, vocab=512),
                      # the TorchScript apply_rotary_pos_emb graph, forward and backward
                      "rope": f(heads=2, rot_dim=16, tokens=16)}.items():
        assert got.get((op, "fwd", feats)) == 2, (op, got)
        assert got.get((op, "bwd", feats)) == 2, (op, got)
    # NeoX's bias_dropout_add: the linear's bias, not a third residual add per layer
    assert got[("res_add", "fwd", f(d=32, tokens=16))] == 4
    assert "bias add of a RowParallelLinear (skip_bias_add)" in r.glue
    # gradient accumulation into .grad and the model-parallel region copies join operators
    assert "backward: torch::autograd::AccumulateGrad" in r.glue
    assert "backward: _CopyToModelParallelRegionBackward" in r.glue
    assert not any(n.startswith("backward:") for n in r.unmapped)
    assert _share(r, pipeline=True) >= 0.95


def test_neox_tensor_parallel_layer_maps_whole():
    events, ctx = load_trace("neox_mp2_learned.json")
    r = map_events(events, ctx)
    got = ops(r)
    # mp=2: QKV 3h/2, dense and 4h->h split on k, the vocab-parallel head and loss on V/2
    assert got[("linear1", "fwd", f(k=32, m=16, n=48))] == 1
    assert got[("linear2", "fwd", f(k=16, m=16, n=32))] == 1
    assert got[("linear4", "bwd", f(k=64, m=16, n=32))] == 1
    assert got[("linear_final", "fwd", f(k=32, m=16, n=256))] == 1
    assert got[("cross_entropy", "bwd", f(tokens=16, vocab=256))] == 1
    assert not any(k[0] == "rope" for k in got)  # learned positions
    # the row-parallel reductions of one layer (attention and MLP) in forward, on 2 ranks
    assert got[("allreduce", "comm", f(elements=512, gpus_per_node=2, nodes=1))] >= 2
    assert r.op_phases[("allreduce", "forward")] > 0
    assert _share(r, pipeline=False) >= 0.95
    assert _share(r, pipeline=False) <= 1.0 + 1e-9  # waits inside c10d are not counted twice


def test_neox_torchscript_functions_are_named():
    d = Dims(hidden=64, qkv=96, ffn_out=256, ffn_in=256, vocab=128, hidden_local=64)
    events = [
        _ev(0, "neox_perf::forward", 0, 100),
        # apply_rotary_pos_emb(q [s, b, heads, rot], k [s, b, kv, rot], cos, sin): GQA 4/2
        _ev(1, "apply_rotary_pos_emb", 1, 10, 0, [[16, 2, 4, 8], [16, 2, 2, 8], [16, 1, 1, 8],
                                                  [16, 1, 1, 8], []]),
        _ev(2, "aten::mul", 2, 3, 1, [[16, 2, 4, 8], [16, 1, 1, 8]], seq=5),
        # bias_gelu_fusion: GeLUFunction.apply(input [s, b, 4h], bias [4h]) around the graph
        _ev(3, "GeLUFunction", 20, 10, 0, [[16, 2, 256], [256]], seq=6),
        _ev(4, "bias_gelu", 21, 8, 3, [[256], [16, 2, 256]]),
    ]
    got = ops(map_events(events, MapContext(dims=d)))
    assert got == {("rope", "fwd", f(heads=3, rot_dim=8, tokens=32)): 1,
                   ("gelu", "fwd", f(tokens=32, width=256)): 1}


def test_attention_dropout_maps_on_the_probabilities_only():
    # nn.Dropout as torch.profiler records it on a GPU (aten::dropout -> native_dropout) and on
    # a CPU (aten::dropout -> bernoulli_, div_, mul); backward through the sequence number.
    ctx = MapContext(dims=Dims(hidden=64, qkv=192, ffn_out=256, ffn_in=256, vocab=128,
                               hidden_local=64))
    events = [
        _ev(0, "neox_perf::forward", 0, 100),
        _ev(1, "aten::dropout", 1, 10, 0, [[2, 8, 32, 32]], seq=1),
        _ev(2, "aten::native_dropout", 2, 8, 1, [[2, 8, 32, 32]]),
        _ev(3, "aten::dropout", 20, 10, 0, [[2, 8, 32, 32]], seq=2),
        _ev(4, "aten::bernoulli_", 21, 4, 3, [[2, 8, 32, 32]]),
        _ev(5, "aten::mul", 26, 3, 3, [[2, 8, 32, 32], [2, 8, 32, 32]]),
        # hidden dropout on [s, b, h]: not the attention's
        _ev(6, "aten::dropout", 40, 5, 0, [[32, 2, 64]], seq=3),
        # nn.Dropout(0) records aten::dropout but hands its input back: no operator
        Event(9, "aten::dropout", 0, 1, 50, 1, shapes=[[2, 8, 32, 32]], seq=4,
              concrete=[None, 0.0, True]),
        _ev(7, "neox_perf::backward", 200, 100),
        _ev(8, "autograd::engine::evaluate_function: NativeDropoutBackward0", 210, 6, 7, seq=1),
    ]
    r = map_events(events, ctx)
    got = ops(r)
    assert got[("attn_dropout", "fwd", f(batch=16, l=32))] == 2
    assert got[("attn_dropout", "bwd", f(batch=16, l=32))] == 1
    assert not any(op == "attn_dropout" and dict(feats)["l"] != 32 for op, _, feats in got)
    # the hidden dropout has no operator of its own: it joins the nearest one, as glue
    assert "aten::dropout" in r.glue and not r.unmapped
