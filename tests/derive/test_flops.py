import pytest

from neox_perf.derive import derive

from derive_specs import LLAMA_7B, RAW_VOCAB_20B, make_config


def test_matches_neox_hfu_for_standard_model(neox20b):
    # 24 f B s L h^2 (1 + s/6h + V/16Lh) with f = 4 is exactly our 3x forward + recomputed layers
    # when every layer is checkpointed and the model is the plain GELU/MHA one (biases aside).
    d = derive(neox20b, RAW_VOCAB_20B)
    assert d.flops.hardware_per_iteration == pytest.approx(d.flops.neox_hfu_per_iteration, rel=1e-12)
    tokens = neox20b.training.train_batch_size * 2048
    # NeoX's MFU formula counts the head as 4.5 h V per token instead of 6 h V.
    assert (d.flops.model_per_iteration - d.flops.neox_mfu_per_iteration
            == pytest.approx(1.5 * 6144 * 50432 * tokens, rel=1e-9))


def test_tokens(neox20b):
    d = derive(neox20b, RAW_VOCAB_20B)
    assert d.tokens.per_iteration == 1536 * 2048
    assert d.tokens.total == 1536 * 2048 * 150000
    assert d.flops.model_total == d.flops.model_per_iteration * 150000


def test_per_op_counts():
    h, s, L = 4096, 4096, 32
    d = derive(make_config(**LLAMA_7B), 32000)
    f = d.flops
    assert f.attention_linear_per_token == L * (2 * h * 3 * h + 2 * h * h)
    assert f.attention_scores_per_token == L * 4 * s * h
    assert f.mlp_per_token == L * (2 * h * 22016 + 2 * 11008 * h)
    assert f.head_per_token == 2 * h * 32000
    assert f.model_per_iteration == 3 * f.forward_per_token * s  # one sample per iteration
    assert f.hardware_per_iteration == f.model_per_iteration  # no checkpointing


def test_gqa_fewer_flops():
    mha = derive(make_config(hidden_size=1024, num_attention_heads=16), 100).flops
    gqa = derive(make_config(hidden_size=1024, num_attention_heads=16, num_kv_heads=4), 100).flops
    layers = 2
    assert (mha.attention_linear_per_token - gqa.attention_linear_per_token
            == layers * 2 * 2 * 1024 * (1024 - 256))  # K and V shrink from h to kv * head_dim
    assert mha.attention_scores_per_token == gqa.attention_scores_per_token


def test_checkpoint_recompute_counts_only_checkpointed_chunks():
    cfg = make_config(num_layers=8, checkpoint_activations=True, checkpoint_num_layers=3)
    d = derive(cfg, 100)
    # chunks of 3 over [Emb, _pre, L0..L7, _post, Norm, Head]: only [L1 L2 L3] and [L4 L5 L6]
    per_layer = (d.flops.forward_per_token - d.flops.head_per_token) // 8
    tokens = cfg.training.train_batch_size * cfg.model.seq_length
    assert d.flops.hardware_per_iteration - d.flops.model_per_iteration == 6 * per_layer * tokens
