import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.prediction.operators import CommCall, OpCall, StageShape, decompose, group_placement, mlp_widths

BASE = """
num_layers: 8
hidden_size: 512
num_attention_heads: 8
seq_length: 256
max_position_embeddings: 256
train_micro_batch_size_per_gpu: 2
gradient_accumulation_steps: 4
fp16: {enabled: true}
zero_optimization: {stage: 1, reduce_bucket_size: 1000000, allgather_bucket_size: 1000000}
"""


def cfg_of(write_yaml, extra="", gpus=8, gpn=4):
    path = write_yaml("c.yml", BASE + extra)
    cfg, verdicts, _ = build(load_files([path]), WorldRequest(gpus=gpus, gpus_per_node=gpn))
    return cfg


def shapes(n_stages, layers=8, params=3_000_000):
    per = layers // n_stages
    return [StageShape(i, per, i == 0, i == n_stages - 1, params) for i in range(n_stages)]


def comm(calls, purpose):
    return [c for c in calls if isinstance(c, CommCall) and c.purpose == purpose]


def test_group_placement_follows_deepspeed_rank_order():
    assert group_placement(4, 1, 4) == (1, 4)  # TP inside a node
    assert group_placement(8, 1, 4) == (2, 4)
    assert group_placement(8, 4, 4) == (8, 1)  # dp stride = mp fills nodes: one per node
    assert group_placement(4, 2, 4) == (2, 2)
    assert group_placement(1, 1, 4) == (1, 1)


def test_tp_allreduce_counts_standard_and_gptj(write_yaml):
    cfg = cfg_of(write_yaml, "model_parallel_size: 2\n")
    st = decompose(cfg, 51200, shapes(1)).stages[0]
    fwd = comm(st.layer_forward, "mp_allreduce")
    bwd = comm(st.layer_backward, "mp_allreduce")
    assert sum(c.count for c in fwd) == 2 and sum(c.count for c in bwd) == 2
    assert fwd[0].elements == 2 * 256 * 512 and (fwd[0].nodes, fwd[0].gpus_per_node) == (1, 2)
    cfg = cfg_of(write_yaml, "model_parallel_size: 2\ngpt_j_residual: true\n")
    st = decompose(cfg, 51200, shapes(1)).stages[0]
    assert sum(c.count for c in comm(st.layer_forward, "mp_allreduce")) == 1
    assert sum(c.count for c in comm(st.layer_backward, "mp_allreduce")) == 2


def test_no_tp_communication_without_model_parallelism(write_yaml):
    st = decompose(cfg_of(write_yaml), 50304, shapes(1)).stages[0]
    assert not comm(st.layer_forward + st.forward + st.backward, "mp_allreduce")


def test_gqa_and_swiglu_shapes(write_yaml):
    cfg = cfg_of(write_yaml, "num_kv_heads: 2\nattention_config: [[[flash], 8]]\nactivation: swiglu\n"
                             "intermediate_size: 4096\nmlp_multiple_of: 256\nmodel_parallel_size: 2\n")
    st = decompose(cfg, 51200, shapes(1)).stages[0]
    ops = {c.op: c.feature_dict() for c in st.layer_forward if isinstance(c, OpCall)}
    assert ops["linear1"]["n"] == (512 + 2 * 2 * 64) // 2
    ffn_out, ffn_in = mlp_widths(cfg)
    # gated: int(4096*2/3)=2730, 2730//2=1365; rounded up to 2*256 and 256 multiples.
    assert (ffn_out, ffn_in) == (3072, 1536)
    assert ops["linear3"]["n"] == ffn_out // 2 and ops["linear4"]["k"] == ffn_in // 2
    assert "flash_attention" in ops and ops["flash_attention"]["causal"] == 1
    assert "softmax" not in ops


def test_fused_softmax_only_where_neox_uses_the_kernel(write_yaml):
    cfg = cfg_of(write_yaml, "scaled_upper_triang_masked_softmax_fusion: true\n")
    ops = {c.op for c in decompose(cfg, 50304, shapes(1)).stages[0].layer_forward if isinstance(c, OpCall)}
    assert "fused_softmax" in ops and "softmax" not in ops
    cfg = cfg_of(write_yaml, "scaled_upper_triang_masked_softmax_fusion: true\nseq_length: 4096\n"
                             "max_position_embeddings: 4096\n")
    ops = {c.op for c in decompose(cfg, 50304, shapes(1)).stages[0].layer_forward if isinstance(c, OpCall)}
    assert {"fillmask", "softmax"} <= ops and "fused_softmax" not in ops


@pytest.mark.parametrize("extra, dropped", [
    ("", False),                                   # NeoX's default attention_dropout 0
    ("attention_dropout: 0\nhidden_dropout: 0.1\n", False),  # hidden dropout: the residual add's
    ("attention-dropout: 0.1\n", True),
    ("attention_dropout: 0.1\nuse_flash_attention: true\n", False),  # the flash kernel drops inside
])
def test_attention_dropout_is_an_operator_on_the_probabilities(write_yaml, extra, dropped):
    if "flash" in extra:
        extra = "attention_dropout: 0.1\nattention_config: [[[flash], 8]]\n"
    st = decompose(cfg_of(write_yaml, extra), 50304, shapes(1)).stages[0]
    for calls, phase in ((st.layer_forward, "fwd"), (st.layer_backward, "bwd")):
        got = [c for c in calls if isinstance(c, OpCall) and c.op == "attn_dropout"]
        assert len(got) == int(dropped)
        if dropped:
            # 8 heads at micro-batch 2: 16 score matrices of 256 x 256
            assert got[0].feature_dict() == {"batch": 16.0, "l": 256.0} and got[0].phase == phase
            assert got[0].bytes == (2 * 2 + 1) * 16 * 256 * 256 and got[0].launches == 1
    ops = {c.op for c in st.layer_forward if isinstance(c, OpCall)}
    assert ("flash_attention" in ops) == ("flash" in extra)


@pytest.mark.parametrize("extra, precision, fwd, bwd", [
    # NeoX's default: the mask value becomes a device tensor, then masked_fill_, then softmax
    ("", "fp16: {enabled: true}\n", (2, 1), (1, 1)),
    # softmax in fp32: upcast before the mask, downcast after the softmax
    ("attention_softmax_in_fp32: true\n", "fp16: {enabled: true}\n", (3, 2), (2, 2)),
    # layer-number scaling forces fp32 and adds the scale's multiply
    ("apply_query_key_layer_scaling: true\n", "fp16: {enabled: true}\n", (4, 2), (3, 2)),
    # fp32 scores need no casts
    ("apply_query_key_layer_scaling: true\n", "fp16: {enabled: false}\n", (3, 1), (2, 1)),
])
def test_unfused_softmax_counts_its_framework_calls(write_yaml, extra, precision, fwd, bwd):
    # seq 4096 is past the fused kernel's 2048: NeoX runs forward_torch_softmax
    body = BASE.replace("fp16: {enabled: true}\n", precision)
    path = write_yaml("c.yml", body + extra + "seq_length: 4096\nmax_position_embeddings: 4096\n")
    cfg, _, _ = build(load_files([path]), WorldRequest(gpus=8, gpus_per_node=4))
    st = decompose(cfg, 50304, shapes(1)).stages[0]
    launches = {(c.op, c.phase): c.launches for c in st.layer_forward + st.layer_backward
                if isinstance(c, OpCall)}
    assert (launches["fillmask", "fwd"], launches["softmax", "fwd"]) == fwd
    assert (launches["fillmask", "bwd"], launches["softmax", "bwd"]) == bwd
    assert launches["linear1", "fwd"] == launches["layernorm", "bwd"] == 1


def test_pipeline_p2p_and_dp_buckets(write_yaml):
    cfg = cfg_of(write_yaml, "pipe_parallel_size: 2\nmodel_parallel_size: 2\n", gpus=8, gpn=4)
    d = decompose(cfg, 51200, shapes(2, params=2_500_000))
    first, last = d.stages
    # this rank's activation chunk, and NeoX's [1, 1, l, l] attention mask sent whole beside it
    assert first.send_activation.elements == 2 * 256 * 512 / 2 + 256 * 256 and last.send_activation is None
    assert first.send_gradient is None and last.send_gradient.elements == 2 * 256 * 512 / 2
    # a framework whose stages keep the mask to themselves (Megatron-DeepSpeed) sends the chunk
    bare = decompose(cfg, 51200, shapes(2, params=2_500_000), pipe_sends_mask=False)
    assert bare.stages[0].send_activation.elements == 2 * 256 * 512 / 2
    # mp*dp = 4 ranks per stage fill a 4-GPU node: the neighbour stage is on another node.
    assert (first.send_activation.nodes, first.send_activation.gpus_per_node) == (2, 1)
    sizes = [(c.elements, c.count) for c in first.grad_sync]
    assert sizes == [(1_000_000.0, 2), (500_000.0, 1)]
    assert first.optimizer.feature_dict()["params"] == 2_500_000 / 2  # ZeRO-1 over dp 2
    assert sum(c.count for c in first.param_allgather) == 3
    assert d.micro_batches == 4


def test_recompute_follows_checkpointing(write_yaml):
    assert decompose(cfg_of(write_yaml), 50304, shapes(1)).stages[0].recompute_layers == 0
    cfg = cfg_of(write_yaml, "checkpoint_activations: true\n")
    assert decompose(cfg, 50304, shapes(1)).stages[0].recompute_layers == 8


def test_tied_embedding_sync_only_across_stages(write_yaml):
    cfg = cfg_of(write_yaml, "pipe_parallel_size: 2\n", gpus=2)
    d = decompose(cfg, 50304, shapes(2))
    assert all(len(s.tied_sync) == 1 for s in d.stages)
    cfg = cfg_of(write_yaml, "pipe_parallel_size: 2\nno_weight_tying: true\n", gpus=2)
    assert all(not s.tied_sync for s in decompose(cfg, 50304, shapes(2)).stages)


def test_partitioned_p2p_is_all_gathered_on_receipt(write_yaml):
    # DeepSpeed's PipelineEngine with mp > 1: a stage past the first gathers its input in
    # forward; a stage before the last gathers its own output and the received gradient in
    # backward; each rank contributes its b*l*d/mp chunk, over the tensor-parallel group
    cfg = cfg_of(write_yaml, "pipe_parallel_size: 3\nmodel_parallel_size: 2\nnum_layers: 9\n",
                 gpus=12, gpn=4)
    d = decompose(cfg, 51200, shapes(3, layers=9))
    chunk = 2 * 256 * 512 / 2
    for st, (n_fwd, n_bwd) in zip(d.stages, [(0, 2), (1, 2), (1, 0)]):
        fwd, bwd = comm(st.forward, "pp_allgather"), comm(st.backward, "pp_allgather")
        assert sum(c.count for c in fwd) == n_fwd and sum(c.count for c in bwd) == n_bwd
        for c in fwd + bwd:
            assert (c.kind, c.elements, c.nodes, c.gpus_per_node) == ("allgather", chunk, 1, 2)
        assert st.send_gradient is None or st.send_gradient.elements == chunk
    # wider than a node, the group crosses nodes as the tensor-parallel all-reduce does
    cfg = cfg_of(write_yaml, "pipe_parallel_size: 2\nmodel_parallel_size: 8\nnum_attention_heads: 16\n",
                 gpus=16, gpn=4)
    gather = comm(decompose(cfg, 51200, shapes(2)).stages[1].forward, "pp_allgather")[0]
    assert (gather.nodes, gather.gpus_per_node, gather.elements) == (2, 4, 2 * 256 * 512 / 8)


@pytest.mark.parametrize("extra,gpus", [("pipe_parallel_size: 2\n", 2),
                                        ("model_parallel_size: 2\n", 2),
                                        ("pipe_parallel_size: 1\nmodel_parallel_size: 2\n", 2)])
def test_no_partition_gather_without_both_pipeline_and_tensor_parallelism(write_yaml, extra, gpus):
    cfg = cfg_of(write_yaml, extra, gpus=gpus)
    n = max(cfg.parallel.pipe_parallel_size, 1)
    for st in decompose(cfg, 51200, shapes(n)).stages:
        assert not comm(st.forward + st.backward, "pp_allgather")


def test_turning_partitioning_off_is_noted(write_yaml):
    extra = ("pipe_parallel_size: 2\nmodel_parallel_size: 2\n"
             "deepspeed_extra_args: {pipeline: {grad_partitioned: false}}\n")
    assert any("grad_partitioned" in n for n in decompose(cfg_of(write_yaml, extra), 51200, shapes(2)).notes)
    plain = cfg_of(write_yaml, "pipe_parallel_size: 2\nmodel_parallel_size: 2\n")
    assert not any("partitioned" in n for n in decompose(plain, 51200, shapes(2)).notes)
