"""Per-stage memory: model states per DeepSpeed wrapper, NeoX's saved tensors under 1F1B and
checkpointing, the peak's components, and the device terms above it."""
from dataclasses import replace

import pytest

from neox_perf.derive import DeriveOptions, derive, optimizer_state_bytes
from neox_perf.derive.activations import ActivationContext, transformer_saved
from neox_perf.derive.device_memory import TERMS, usable
from neox_perf.derive.memory import COLUMNS, COMPONENTS, columns

from derive_specs import RAW_VOCAB_20B, make_config, with_parallel

GIB = 2 ** 30


def mem(config, raw_vocab=1000, gpu=None, device="cuda"):
    return [s.memory for s in derive(config, raw_vocab, gpu, device=device).stages]


def small(**kw):
    base = dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=512,
                max_position_embeddings=512, micro_batch_size=2, gradient_accumulation_steps=8)
    return make_config(**dict(base, **kw))


# -- model states: which wrapper DeepSpeed builds ------------------------------------------------

def test_fp16_adam_no_zero_is_16_bytes_per_param():
    d = derive(small(world_size=1), 1000)
    m = d.stages[0].memory
    p = d.stages[0].params_per_rank
    assert m.optimizer_wrapper == "FP16_Optimizer"
    assert (m.weights, m.gradients, m.master_weights, m.optimizer_states) == (2 * p, 2 * p, 4 * p, 8 * p)
    assert m.persistent == 16 * p
    assert m.step_transient == 8 * p  # fp32 copies of the grads, flattened, inside step()


def test_fp32_no_master_copy():
    d = derive(small(precision="fp32"), 1000)
    m, p = d.stages[0].memory, d.stages[0].params_per_rank
    assert (m.weights, m.gradients, m.master_weights, m.optimizer_states) == (4 * p, 4 * p, 0, 8 * p)


def test_zero1_shards_optimizer_states_by_dp(neox20b):
    a = derive(neox20b, RAW_VOCAB_20B).stages[1].memory  # dp = 12
    b = derive(with_parallel(neox20b, data_parallel_size=24, world_size=192),
               RAW_VOCAB_20B).stages[1].memory
    assert a.optimizer_wrapper == "DeepSpeedZeroOptimizer (ZeRO-1)"
    assert b.optimizer_states == pytest.approx(a.optimizer_states / 2, rel=1e-9)
    assert b.master_weights == pytest.approx(a.master_weights / 2, rel=1e-9)
    assert b.weights == a.weights  # ZeRO-1 keeps every fp16 weight ...
    assert b.gradients == a.gradients  # ... and every fp16 param.grad through backward
    # the 20B config overlaps communication: the gradient hooks allocate two contiguous
    # reduce buckets of reduce_bucket_size fp16 elements at the first backward
    assert a.zero_buffers == 2 * 1_260_000_000 * 2


def test_zero2_shards_gradients():
    one = derive(small(zero_stage=1, world_size=8, pipe_parallel_size=0), 1000).stages[0]
    two = derive(small(zero_stage=2, world_size=8, pipe_parallel_size=0), 1000).stages[0]
    p = one.params_per_rank
    assert one.memory.gradients == 2 * p  # contiguous_gradients off (no zero dict: NeoX default)
    assert two.memory.gradients == pytest.approx(2 * p / 8, abs=1)


def test_bf16_pipeline_uses_bf16_optimizer_with_persistent_gradients():
    d = derive(small(precision="bfloat16", world_size=4), 1000)
    m, p = d.stages[0].memory, d.stages[0].params_per_rank
    assert m.optimizer_wrapper == "BF16_Optimizer"
    assert m.master_weights == pytest.approx(4 * p / 4, abs=1)
    assert m.optimizer_states == pytest.approx(8 * p / 4, abs=1)
    assert m.gradients == 4 * p  # bf16 param.grad + bf16 accumulation buffer
    # they live through the whole run: the first backward of an iteration already has them
    assert m.peak["gradients"] == m.gradients
    cfg = small(precision="bfloat16", world_size=4, values={"data_types": {"grad_accum_dtype": "fp32"}})
    d = derive(cfg, 1000)
    assert d.stages[0].memory.gradients == 6 * p
    from neox_perf.refusals import config_refusals  # DeepSpeed refuses this mix at ZeRO 0
    assert [v.code for v in config_refusals(cfg)] == ["grad_accum_dtype_zero0"]


@pytest.mark.parametrize("opt,momentum,expected", [
    ("adam", None, 8), ("lion", None, 4), ("sgd", None, 0), ("sgd", 0.9, 4),
    ("madgrad_wd", None, 12), ("madgrad_wd", 0, 8), ("cpu_adam", None, 0),
    ("onebitadam", None, 8), ("sm3", None, 0)])
def test_optimizer_state_sizes(opt, momentum, expected):
    assert optimizer_state_bytes(opt, DeriveOptions(optimizer_momentum=momentum)) == expected


def test_cpu_adam_keeps_states_off_gpu():
    d = derive(small(optimizer_type="cpu_adam"), 1000)
    m = d.stages[0].memory
    assert m.optimizer_states == 0 and m.master_weights == 0


# -- what one micro-batch keeps --------------------------------------------------------------


class _Layer:
    name, attention_type, moe = "ParallelTransformerLayerPipe", "global", False


def _ctx(cfg, **kw):
    fields = dict(model=cfg.model, micro_batch=2, tp=1, seq_div=1, act_bytes=4,
                  opts=DeriveOptions(), partition_activations=False, pipelined=True,
                  precision="fp32", param_bytes=4)
    fields.update(kw)
    return ActivationContext(**fields)


def test_a_neox_layer_keeps_what_the_hook_measured_on_cpu():
    """NeoX's ParallelTransformerLayer in fp32 (layernorm, MHA, TorchScript rotary, gelu, no
    dropout), s 256, b 2, h 256, 4 heads: the hook measured 12,066,816 bytes recomputed by a
    checkpointed layer (benchmarks/memory_table.py, layout ckpt): per token 19 h + a s floats
    (input norm output, QKV output, rotated q and k, the -x2 halves, probabilities, context,
    attention output + residual, post-attention norm output, gelu input and output, the layer
    output) and the two norms' mean and rstd."""
    cfg = make_config(hidden_size=256, num_attention_heads=4, seq_length=256,
                      max_position_embeddings=256, pos_emb="rotary")
    items = dict(transformer_saved(_ctx(cfg), _Layer()))
    assert sum(items.values()) == 12_066_816
    tokens = 512
    assert items["attention probabilities"] == 4 * 4 * 256 * 256 * 2
    assert items["rotate_half -x2 (TorchScript)"] == 4 * 256 * tokens
    # learned positions: no rotated copies of q and k, no -x2 halves
    learned = dict(transformer_saved(_ctx(replace(cfg, model=replace(cfg.model, pos_emb="learned"))),
                                     _Layer()))
    assert sum(items.values()) - sum(learned.values()) == 4 * 3 * 256 * tokens


def test_fp16_paths_keep_half_tensors_and_fp32_where_neox_upcasts():
    cfg = make_config(hidden_size=1024, num_attention_heads=16, seq_length=1024, pos_emb="rotary")
    half = dict(transformer_saved(_ctx(cfg, act_bytes=2, precision="fp16", micro_batch=1), _Layer()))
    full = dict(transformer_saved(_ctx(cfg, micro_batch=1), _Layer()))
    assert half["attention probabilities"] * 2 == full["attention probabilities"]
    assert half["input norm mean, rstd"] == full["input norm mean, rstd"]  # fp32 either way
    fp32_softmax = dict(transformer_saved(_ctx(cfg, act_bytes=2, precision="fp16", micro_batch=1,
                                               opts=DeriveOptions(attention_softmax_in_fp32=True)),
                                          _Layer()))
    assert "attention probabilities fp32" in fp32_softmax
    # bf16 runs the eager rotary: no TorchScript halves
    bf16 = dict(transformer_saved(_ctx(cfg, act_bytes=2, precision="bfloat16", micro_batch=1), _Layer()))
    assert "rotate_half -x2 (TorchScript)" not in bf16 and "rotate_half -x2 (TorchScript)" in half

    class Flash(_Layer):
        attention_type = "flash"
    flash = dict(transformer_saved(_ctx(cfg, act_bytes=2, precision="bfloat16", micro_batch=1), Flash()))
    assert not any("probabilities" in k for k in flash) and "flash logsumexp fp32" in flash


# -- the stage's peak ----------------------------------------------------------------------------


def test_the_peak_adds_up_and_the_table_columns_hold_every_byte(neox20b):
    for m in mem(neox20b, RAW_VOCAB_20B, 40 * GIB):
        assert set(m.peak) == set(COMPONENTS)
        assert sum(m.peak.values()) == m.total == max(m.backward_peak, m.step_peak)
        assert m.device_total == m.total + sum(m.device_terms.values())
        assert set(m.device_terms) == set(TERMS)
        cols = columns(m)
        assert list(cols) == [c for c, _ in COLUMNS] + ["device overhead"]
        assert sum(cols.values()) == m.device_total
        assert m.headroom == usable(40 * GIB) - m.device_total


def test_a_cpu_run_has_no_device_terms():
    for m in mem(small(precision="fp32"), device="cpu"):
        assert m.device_terms == {} and m.device_total == m.total


def test_stage0_holds_more_micro_batches_than_last(neox20b):
    stages = derive(neox20b, RAW_VOCAB_20B).stages
    flights = [s.memory.micro_batches_in_flight for s in stages]
    assert flights == [4, 3, 2, 1]  # min(pp - s, gas)
    # Stage 0 and stage 2 have 11 transformer layers each, stage 0 keeps twice the micro-batches.
    assert stages[0].memory.activations > 1.9 * stages[2].memory.activations
    few = derive(replace(neox20b, training=replace(neox20b.training, gradient_accumulation_steps=2,
                                                   train_batch_size=96)), RAW_VOCAB_20B)
    assert [s.memory.micro_batches_in_flight for s in few.stages] == [2, 2, 2, 1]


def test_checkpointing_keeps_inputs_and_recomputes_one_chunk():
    plain = mem(small(pipe_parallel_size=2, world_size=2))
    ckpt = mem(small(pipe_parallel_size=2, world_size=2, checkpoint_activations=True))
    for a, b in zip(plain, ckpt):
        assert b.activations < a.activations / 5
        assert b.recompute > 0 and a.recompute == 0


def test_checkpoint_chunks_of_two_layers_keep_fewer_inputs():
    one = mem(small(checkpoint_activations=True, checkpoint_num_layers=1))[0]
    two = mem(small(checkpoint_activations=True, checkpoint_num_layers=2))[0]
    assert two.recompute > one.recompute
    assert two.activations < one.activations


def test_logits_live_on_the_last_stage_only(neox20b):
    stages = derive(neox20b, RAW_VOCAB_20B).stages
    assert stages[-1].memory.logits > 0 and all(s.memory.logits == 0 for s in stages[:-1])
    assert stages[0].memory.embedding >= 0 and all(s.memory.embedding == 0 for s in stages[1:])
    # the pipeline's two output slots keep their micro-batch's logits [b, s, V/mp] in fp16
    b, s, v = 4, 2048, 50432 // 4
    last = stages[-1].memory
    assert last.peak["logits"] >= 2 * b * s * v * 2


def test_sequence_parallel_and_partition_activations_reduce_memory():
    base = small(model_parallel_size=4, world_size=4, checkpoint_activations=True)
    sp = small(model_parallel_size=4, world_size=4, checkpoint_activations=True,
               sequence_parallel=True)
    part = small(model_parallel_size=4, world_size=4, checkpoint_activations=True,
                 partition_activations=True)
    a, b, c = mem(base)[0], mem(sp)[0], mem(part)[0]
    assert b.activations < a.activations and c.activations < a.activations


def test_unfused_rmsnorm_keeps_fp32_copies():
    ln = sum(b for _, b in transformer_saved(_ctx(make_config(norm="layernorm"), act_bytes=2,
                                                  precision="fp16"), _Layer()))
    rms = sum(b for _, b in transformer_saved(_ctx(make_config(norm="rmsnorm"), act_bytes=2,
                                                   precision="fp16"), _Layer()))
    tokens, h = 2 * 128, 64
    # per norm: x in fp32 and x_normed in fp32, rsqrt [tokens, 1]; LayerNorm's mean and rstd
    assert rms - ln == 2 * (8 * h * tokens + 4 * tokens - 8 * tokens)


def test_the_pipeline_reduce_bucket_comes_at_step_time(neox20b):
    m = derive(neox20b, RAW_VOCAB_20B).stages[-1].memory
    assert m.step_peak >= m.persistent + m.zero_buffers
    if m.total == m.step_peak:
        assert m.peak["buffers"] >= m.zero_buffers and m.peak["activations"] == 0


def test_per_kind_memo_equals_each_block_worked_out_alone():
    """memory.py works out a block's saved tensors and backward once per kind of block (its name,
    attention type and MoE): on a model mixing every kind, each block's own answer is the
    memo's, so nothing a block reads is left out of the kind."""
    from neox_perf.derive.activations import block_backward, block_saved
    from neox_perf.derive.layers import build_layers
    from neox_perf.derive.memory import _backward, _kind, _saved
    kinds = ("global", "flash", "local", "gmlp", "amlp", "global", "flash", "global")
    cfg = small(attention_types=kinds, moe_num_experts=2, moe_expert_interval=2)
    layers = [l for l in build_layers(cfg.model, 2, 1024, DeriveOptions()) if l.is_block]
    assert len({_kind(l) for l in layers}) >= 5
    ctx = ActivationContext(model=cfg.model, micro_batch=2, tp=2, seq_div=1, act_bytes=2,
                            opts=DeriveOptions(hidden_dropout=0.1), partition_activations=False,
                            pipelined=True)
    for layer in layers:
        items = block_saved(ctx, layer)
        assert _saved(ctx, _kind(layer)) == (sum(b for _, b in items), len(items))
        for accumulate in (False, True):
            for incoming, transposed in ((0.0, False), (ctx.gathered, True)):
                assert (_backward(ctx, _kind(layer), accumulate, incoming, transposed)
                        == block_backward(ctx, layer, accumulate, incoming, transposed=transposed))
