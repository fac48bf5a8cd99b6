"""The workload's modules on one process, no torch.distributed: shapes and parameter counts
against NeoX's width rules (our formulas and neox_perf.derive), and the loss path."""
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from neox_perf.calibration.workload import dims  # noqa: E402
from neox_perf.calibration.workload.data import SyntheticTokens  # noqa: E402
from neox_perf.calibration.workload.ds_config import build_ds_config  # noqa: E402
from neox_perf.calibration.workload.layers import ParallelTransformerLayer  # noqa: E402
from neox_perf.calibration.workload.model import SequentialModel, build_layers  # noqa: E402
from neox_perf.calibration.workload.model import count_params, cross_entropy  # noqa: E402
from neox_perf.calibration.workload.tensor_parallel import TPState, set_tp_state  # noqa: E402

from workload_specs import VOCAB  # noqa: E402

VARIANTS = {
    "neox20b-like": {},
    "learned-tied": dict(pos_emb="learned", no_weight_tying=False),
    "llama-like": dict(activation="swiglu", norm="rmsnorm", num_kv_heads=2,
                       use_bias_in_attn_linear=False, use_bias_in_mlp=False,
                       intermediate_size=256, mlp_multiple_of=16),
    "gptj-flash": dict(gpt_j_residual=True, attention_config=[[["flash", "global"], "all"]],
                       norm="scalenorm", pos_emb="sinusoidal"),
}


@pytest.fixture
def tp2():
    """Build as TP rank 1 of 2 (construction needs no process group)."""
    set_tp_state(TPState(rank=1, world_size=2))
    yield
    set_tp_state(TPState())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_per_spec_params_match_formula_and_derive(neox_cfg, name):
    from neox_perf import derive
    cfg = neox_cfg(**VARIANTS[name])
    wc = dims.from_neox(cfg, VOCAB)
    built = [count_params(layer) for layer in build_layers(wc)]
    assert built == dims.spec_params(wc, local=True)
    theirs = [l.params for l in derive.build_layers(cfg.model, 1, wc.vocab)]
    if wc.tied:  # derive counts the tied head's own EmbeddingPipe copy; ours reuses the module
        assert theirs[-1] == theirs[0]
        theirs[-1] = 0
    assert built == theirs


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tp_rank_holds_its_shard(neox_cfg, name, tp2):
    from neox_perf import derive
    cfg = neox_cfg(world=2, model_parallel_size=2, **VARIANTS[name])
    wc = dims.from_neox(cfg, VOCAB)
    built = [count_params(layer) for layer in build_layers(wc)]
    assert built == dims.spec_params(wc, local=True)
    theirs = [l.params for l in derive.build_layers(cfg.model, 2, wc.vocab)]
    assert built[:-1] == theirs[:-1]


def test_shapes_and_loss_single_process(neox_cfg):
    cfg = neox_cfg(pos_emb="learned")
    wc = dims.from_neox(cfg, VOCAB)
    assert wc.vocab == 512 and (wc.ffn, wc.ffn_in) == (256, 256)
    layer = build_layers(wc)[2]
    assert tuple(layer.attention.query_key_value.weight.shape) == (3 * 64, 64)
    assert tuple(layer.mlp.linear2.weight.shape) == (64, 256)
    model = SequentialModel(wc, checkpoint_interval=0)
    inputs, labels = SyntheticTokens(1, VOCAB, 32, 2, 0, "cpu").micro_batch(0, 0)
    assert inputs[0].shape == (2, 32) and inputs[2].shape == (1, 1, 32, 32)
    assert int(inputs[0].max()) < VOCAB
    logits = model(inputs)
    assert logits.shape == (2, 32, 512)
    loss = cross_entropy(logits, labels)
    assert torch.isfinite(loss) and 5.5 < loss.item() < 7.0  # ~ln(512) at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_vocab_parallel_ce_matches_torch():
    logits = torch.randn(3, 5, 17)
    target = torch.randint(0, 17, (3, 5))
    loss = cross_entropy(logits.clone(), (target, torch.ones(3, 5)))
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 17), target.view(-1))
    assert torch.allclose(loss, expected)


def test_flash_layer_equals_unfused_layer(neox_cfg):
    wc = dims.from_neox(neox_cfg(num_kv_heads=2), VOCAB)
    flash_wc = dataclasses.replace(wc, attention_types=("flash",) * wc.num_layers)
    unfused, flash = ParallelTransformerLayer(wc, 0), ParallelTransformerLayer(flash_wc, 0)
    flash.load_state_dict(unfused.state_dict())  # same seed and names: already equal
    x = torch.randn(32, 2, 64)
    mask = SyntheticTokens(1, VOCAB, 32, 2, 0, "cpu").mask
    assert torch.allclose(unfused(x, mask), flash(x, mask), atol=1e-5)


def test_gated_mlp_widths_follow_neox(neox_cfg):
    # LLaMA-7B's MLP: the workload is built at the widths derive gives NeoX's ParallelMLP
    cfg = neox_cfg(hidden_size=4096, num_attention_heads=32, activation="swiglu",
                   intermediate_size=32768, mlp_multiple_of=256, seq_length=64,
                   max_position_embeddings=64)
    wc = dims.from_neox(cfg, VOCAB)
    assert (wc.ffn, wc.ffn_in) == (22016, 11008)
    plain = dims.from_neox(neox_cfg(hidden_size=64, num_attention_heads=4), VOCAB)
    assert (plain.ffn, plain.ffn_in) == (256, 256)


def test_unsupported_features_refused(neox_cfg):
    with pytest.raises(dims.UnsupportedConfig, match="alibi"):
        dims.from_neox(neox_cfg(pos_emb="alibi"), VOCAB)
    with pytest.raises(dims.UnsupportedConfig, match="linear1 gives 2 x"):
        dims.from_neox(neox_cfg(activation="swiglu", intermediate_size=200), VOCAB)


def test_synthetic_tokens_are_deterministic():
    a = SyntheticTokens(7, VOCAB, 32, 2, dp_rank=0, device="cpu")
    b = SyntheticTokens(7, VOCAB, 32, 2, dp_rank=0, device="cpu")
    c = SyntheticTokens(7, VOCAB, 32, 2, dp_rank=1, device="cpu")
    assert torch.equal(a.micro_batch(3, 1)[0][0], b.micro_batch(3, 1)[0][0])
    assert not torch.equal(a.micro_batch(3, 1)[0][0], c.micro_batch(3, 1)[0][0])
    assert torch.equal(a.micro_batch(3, 1)[1][0][:, :-1], a.micro_batch(3, 1)[0][0][:, 1:])


def test_ds_config_on_cpu(neox_cfg):
    cfg = neox_cfg(fp16={"enabled": True, "loss_scale": 0}, zero_optimization={"stage": 1})
    conf, notes = build_ds_config(cfg, "cpu")
    # DeepSpeed builds its FusedAdam, as NeoX does without apex (a CPU op on a CPU)
    assert "torch_adam" not in conf["optimizer"]["params"]
    assert "fp16" not in conf and conf["zero_optimization"] == {"stage": 1}
    assert conf["train_batch_size"] == 4 and conf["gradient_accumulation_steps"] == 2
    assert any("fp32" in n for n in notes)
    gpu, _ = build_ds_config(cfg, "cuda")
    assert gpu["fp16"] == {"enabled": True, "loss_scale": 0}
    assert "torch_adam" not in gpu["optimizer"]["params"]


@pytest.mark.parametrize("interval,chunks", [(0, 0), (1, 4), (2, 2), (3, 1)])
def test_sequential_checkpoints_whole_transformer_chunks(neox_cfg, mocker, interval, chunks):
    # NeoX's SequentialWrapper: chunks of `interval` specs counted from the embedding, and only
    # chunks made of transformer layers alone are recomputed.
    from deepspeed.runtime.activation_checkpointing import checkpointing
    wc = dims.from_neox(neox_cfg(), VOCAB)
    calls = mocker.patch.object(checkpointing, "checkpoint", side_effect=checkpointing.checkpoint)
    torch.manual_seed(0)
    inputs, labels = SyntheticTokens(1, VOCAB, 32, 2, 0, "cpu").micro_batch(0, 0)
    model = SequentialModel(wc, checkpoint_interval=interval)
    cross_entropy(model(inputs), labels).backward()
    assert calls.call_count == chunks
    plain = SequentialModel(wc, checkpoint_interval=0)
    cross_entropy(plain(inputs), labels).backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
