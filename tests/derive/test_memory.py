"""Per-stage memory: model states per DeepSpeed wrapper, activations under 1F1B + checkpointing."""
from dataclasses import replace

import pytest

from neox_perf.derive import DeriveOptions, derive, optimizer_state_bytes
from neox_perf.derive.memory import ActivationContext, transformer_activation

from derive_specs import RAW_VOCAB_20B, make_config, with_parallel

GIB = 2 ** 30


def mem(config, raw_vocab=1000, gpu=None):
    return [s.memory for s in derive(config, raw_vocab, gpu).stages]


def small(**kw):
    base = dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=512,
                max_position_embeddings=512, micro_batch_size=2, gradient_accumulation_steps=8)
    return make_config(**dict(base, **kw))


def test_fp16_adam_no_zero_is_16_bytes_per_param():
    d = derive(small(world_size=1), 1000)
    m = d.stages[0].memory
    p = d.stages[0].params_per_rank
    assert m.optimizer_wrapper == "FP16_Optimizer"
    assert (m.weights, m.gradients, m.master_weights, m.optimizer_states) == (2 * p, 2 * p, 4 * p, 8 * p)
    assert m.persistent == 16 * p
    assert m.step_transient == 4 * p  # flat fp32 grads inside step()


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
    assert b.gradients > a.gradients / 2  # ... and the full fp16 gradients
    assert a.zero_buffers == 1_260_000_000 * 2  # one contiguous reduce bucket (pipeline path)


def test_zero2_shards_gradients():
    one = derive(small(zero_stage=1, world_size=8, pipe_parallel_size=0), 1000).stages[0]
    two = derive(small(zero_stage=2, world_size=8, pipe_parallel_size=0), 1000).stages[0]
    p = one.params_per_rank
    assert one.memory.gradients == 2 * p  # contiguous_gradients off (no zero dict: NeoX default)
    assert two.memory.gradients == pytest.approx(2 * p / 8, abs=1)


def test_bf16_pipeline_uses_bf16_optimizer():
    d = derive(small(precision="bfloat16", world_size=4), 1000)
    m, p = d.stages[0].memory, d.stages[0].params_per_rank
    assert m.optimizer_wrapper == "BF16_Optimizer"
    assert m.master_weights == pytest.approx(4 * p / 4, abs=1)
    assert m.optimizer_states == pytest.approx(8 * p / 4, abs=1)
    assert m.gradients == 4 * p  # bf16 param.grad + bf16 accumulation buffer
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


def test_checkpointing_reduces_activations():
    plain = mem(small(pipe_parallel_size=2, world_size=2))
    ckpt = mem(small(pipe_parallel_size=2, world_size=2, checkpoint_activations=True))
    for a, b in zip(plain, ckpt):
        assert b.activations < a.activations / 5
        assert b.recompute > 0 and a.recompute == 0


def test_checkpoint_chunks_of_two_layers_keep_fewer_inputs():
    one = mem(small(checkpoint_activations=True, checkpoint_num_layers=1))[0]
    two = mem(small(checkpoint_activations=True, checkpoint_num_layers=2))[0]
    assert two.recompute > one.recompute
    # stage spec list [Emb, _pre, L0..L7, _post, Norm, Head]: chunks of 2 from the start keep
    # [L0, L1]...[L6, L7] checkpointed -> 4 inputs instead of 8.
    assert two.activations < one.activations


def test_stage0_holds_more_micro_batches_than_last(neox20b):
    stages = derive(neox20b, RAW_VOCAB_20B).stages
    flights = [s.memory.micro_batches_in_flight for s in stages]
    assert flights == [4, 3, 2, 1]  # min(pp - s, gas)
    # Stage 0 and stage 2 have 11 transformer layers each, stage 0 keeps twice the micro-batches.
    assert stages[0].memory.activations > 1.9 * stages[2].memory.activations
    few = derive(replace(neox20b, training=replace(neox20b.training, gradient_accumulation_steps=2,
                                                   train_batch_size=96)), RAW_VOCAB_20B)
    assert [s.memory.micro_batches_in_flight for s in few.stages] == [2, 2, 2, 1]


def test_logits_on_last_stage_embedding_on_first(neox20b):
    stages = derive(neox20b, RAW_VOCAB_20B).stages
    assert stages[-1].memory.logits > 0 and all(s.memory.logits == 0 for s in stages[:-1])
    assert stages[0].memory.embedding > 0 and all(s.memory.embedding == 0 for s in stages[1:])
    # b * s * V/mp * (2 fp16 logits + 4 fp32 loss copy) + 2-byte gradient, plus the head input.
    b, s, v, h = 4, 2048, 50432 // 2, 6144
    assert stages[-1].memory.logits == b * s * v * (2 + 4) + b * s * v * 2 + 2 * h * b * s


def test_headroom(neox20b):
    stages = derive(neox20b, RAW_VOCAB_20B, 40 * GIB).stages
    for s in stages:
        assert s.memory.headroom == 40 * GIB - s.memory.total
        assert s.memory.total == max(s.memory.backward_peak, s.memory.step_peak)
        assert 10 * GIB < s.memory.total < 40 * GIB  # 20B was trained on 40 GB A100s
    assert derive(neox20b, RAW_VOCAB_20B).stages[0].memory.headroom is None


def ctx_for(config, **kw):
    fields = dict(model=config.model, micro_batch=1, tp=1, seq_div=1, act_bytes=2,
                  opts=DeriveOptions(hidden_dropout=0.1, attention_dropout=0.1),
                  partition_activations=False, pipelined=True)
    fields.update(kw)
    return ActivationContext(**fields)


class _Layer:
    name, attention_type, moe = "ParallelTransformerLayerPipe", "global", False


def test_korthikanti_formula():
    cfg = make_config(hidden_size=1024, num_attention_heads=16, seq_length=1024, fused_softmax=True)
    s, b, h, a = 1024, 4, 1024, 16
    got = transformer_activation(ctx_for(cfg, micro_batch=b), _Layer())
    assert got == s * b * h * (34 + 5 * a * s / h)
    # TP without sequence parallelism: sbh (10 + 24/t + 5as/(ht))
    t = 4
    got = transformer_activation(ctx_for(cfg, micro_batch=b, tp=t), _Layer())
    assert got == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


def test_no_dropout_and_flash_drop_terms():
    cfg = make_config(hidden_size=1024, num_attention_heads=16, seq_length=1024, fused_softmax=True)
    s, b, h, a = 1024, 1, 1024, 16
    no_drop = ctx_for(cfg, opts=DeriveOptions())
    # no masks (2 sbh bytes) and no dropout copy of the probabilities: only 2 a s^2 b remain
    assert transformer_activation(no_drop, _Layer()) == s * b * h * (32 + 2 * a * s / h)

    class Flash(_Layer):
        attention_type = "flash"
    flash = transformer_activation(no_drop, Flash())
    assert flash < s * b * h * 40  # no s^2 term at all


def test_sequence_parallel_and_partition_activations_reduce_memory():
    base = small(model_parallel_size=4, world_size=4, checkpoint_activations=True)
    sp = small(model_parallel_size=4, world_size=4, checkpoint_activations=True,
               sequence_parallel=True)
    part = small(model_parallel_size=4, world_size=4, checkpoint_activations=True,
                 partition_activations=True)
    a, b, c = mem(base)[0], mem(sp)[0], mem(part)[0]
    assert b.activations < a.activations and c.activations < a.activations


def test_unfused_rmsnorm_keeps_fp32_copies():
    ln = transformer_activation(ctx_for(make_config(norm="layernorm")), _Layer())
    rms = transformer_activation(ctx_for(make_config(norm="rmsnorm")), _Layer())
    assert rms - ln == 2 * (8 - 2) * 64 * 128  # two norms, 8 instead of 2 bytes per element


def test_zero_buffers_only_at_step_time_with_pipeline(neox20b):
    m = derive(neox20b, RAW_VOCAB_20B).stages[0].memory
    assert m.step_peak == m.persistent + m.step_transient + m.zero_buffers
    assert m.backward_peak == m.persistent + m.activations + m.recompute + m.embedding \
        + m.logits + m.pipe_buffers
