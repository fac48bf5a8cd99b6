"""Build NeoxConfig objects directly (independent of the config loader) for derivation tests."""
from dataclasses import replace

from neox_perf.config.specs import ModelSpec, NeoxConfig, ParallelSpec, TrainingSpec

MODEL_DEFAULTS = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=None, seq_length=128,
    max_position_embeddings=128, intermediate_size=None, expansion_factor=None, mlp_multiple_of=1,
    activation="gelu", norm="layernorm", pos_emb="learned", rotary_pct=1.0, no_weight_tying=False,
    gpt_j_residual=False, use_bias_in_attn_linear=True, use_bias_in_mlp=True,
    use_qk_layernorm=False, attention_types=None, fused_softmax=False,
    make_vocab_size_divisible_by=128, tokenizer_type="HFTokenizer", vocab_file=None,
    moe_num_experts=1, moe_expert_interval=1, rpe_num_buckets=32)

PARALLEL_DEFAULTS = dict(
    world_size=1, world_size_source="test", pipe_parallel_size=1, model_parallel_size=1,
    data_parallel_size=None, pipe_partition_method="type:transformer|mlp",
    sequence_parallel=False, gpus_per_node=8)

TRAINING_DEFAULTS = dict(
    micro_batch_size=1, gradient_accumulation_steps=1, train_batch_size=None, train_iters=None,
    precision="fp16", zero_stage=0, reduce_bucket_size=500_000_000,
    allgather_bucket_size=500_000_000, overlap_comm=False, optimizer_type="adam",
    checkpoint_activations=False, checkpoint_num_layers=1, partition_activations=False,
    fp32_allreduce=False, train_impl="normal")


def make_config(values=None, **kw):
    """NeoxConfig from keyword overrides of any ModelSpec / ParallelSpec / TrainingSpec field.

    Derived fields follow NeoX: num_kv_heads defaults to the head count, attention_types to
    "global" per layer, dp = world / (max(pp,1) * mp), train_batch_size = micro * gas * dp.
    """
    m = {k: kw.pop(k) for k in list(kw) if k in MODEL_DEFAULTS}
    p = {k: kw.pop(k) for k in list(kw) if k in PARALLEL_DEFAULTS}
    t = {k: kw.pop(k) for k in list(kw) if k in TRAINING_DEFAULTS}
    assert not kw, f"unknown fields {sorted(kw)}"
    model = dict(MODEL_DEFAULTS, **m)
    if model["num_kv_heads"] is None:
        model["num_kv_heads"] = model["num_attention_heads"]
    if model["attention_types"] is None:
        model["attention_types"] = ("global",) * model["num_layers"]
    parallel = dict(PARALLEL_DEFAULTS, **p)
    if parallel["data_parallel_size"] is None:
        parallel["data_parallel_size"] = parallel["world_size"] // (
            max(parallel["pipe_parallel_size"], 1) * parallel["model_parallel_size"])
        assert parallel["data_parallel_size"] >= 1, "world_size too small for pp x mp"
    training = dict(TRAINING_DEFAULTS, **t)
    if training["train_batch_size"] is None:
        training["train_batch_size"] = (training["micro_batch_size"]
                                        * training["gradient_accumulation_steps"]
                                        * parallel["data_parallel_size"])
    return NeoxConfig(ModelSpec(**model), ParallelSpec(**parallel), TrainingSpec(**training),
                      files=(), values=dict(values or {}), sources={})


def with_parallel(config, **kw):
    return replace(config, parallel=replace(config.parallel, **kw))


NEOX_20B = dict(
    num_layers=44, hidden_size=6144, num_attention_heads=64, seq_length=2048,
    max_position_embeddings=2048, norm="layernorm", pos_emb="rotary", rotary_pct=0.25,
    no_weight_tying=True, gpt_j_residual=True, fused_softmax=True,
    world_size=96, pipe_parallel_size=4, model_parallel_size=2,
    micro_batch_size=4, gradient_accumulation_steps=32, train_iters=150000,
    precision="fp16", zero_stage=1, reduce_bucket_size=1_260_000_000,
    allgather_bucket_size=1_260_000_000, overlap_comm=True,
    checkpoint_activations=True, checkpoint_num_layers=1)
NEOX_20B_VALUES = {"zero_optimization": {"stage": 1, "contiguous_gradients": True,
                                         "overlap_comm": True},
                   "hidden_dropout": 0, "attention_dropout": 0}
RAW_VOCAB_20B = 50277

# LLaMA-7B as configs/llama2/7B.yml, but without MLP biases (the HF architecture).
LLAMA_7B = dict(
    num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096,
    max_position_embeddings=4096, intermediate_size=32768, mlp_multiple_of=256,
    activation="swiglu", norm="rmsnorm", pos_emb="rotary", no_weight_tying=True,
    use_bias_in_attn_linear=False, use_bias_in_mlp=False, make_vocab_size_divisible_by=1)
