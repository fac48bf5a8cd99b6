"""Parameter counts vs real torch modules that allocate NeoX's per-TP-rank shapes.

The mirror classes below transcribe the __init__ of NeoX's modules (megatron/model/transformer.py,
word_embeddings.py, norms.py, mpu/layers.py) with torch.nn building blocks on the meta device, so
the count comes from torch, not from neox_perf's formulas.
"""
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from neox_perf.derive import derive  # noqa: E402

from derive_specs import make_config  # noqa: E402

META = {"device": "meta"}


def divide(a, b):
    assert a % b == 0
    return a // b


def norm_module(norm, dim):
    if norm == "layernorm":
        return nn.LayerNorm(dim, **META)
    if norm == "rmsnorm":
        m = nn.Module()
        m.scale = nn.Parameter(torch.ones(dim, **META))
        return m
    if norm == "scalenorm":
        m = nn.Module()
        m.g = nn.Parameter(torch.ones(1, **META))
        return m
    if norm == "non_parametric_layernorm":
        return nn.LayerNorm(dim, elementwise_affine=False, bias=False, **META)
    raise ValueError(norm)


class Column(nn.Module):  # ColumnParallelLinear on one rank
    def __init__(self, in_f, out_f, mp, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(divide(out_f, mp), in_f, **META))
        self.bias = nn.Parameter(torch.empty(divide(out_f, mp), **META)) if bias else None


class Row(nn.Module):  # RowParallelLinear on one rank: full bias
    def __init__(self, in_f, out_f, mp, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_f, divide(in_f, mp), **META))
        self.bias = nn.Parameter(torch.empty(out_f, **META)) if bias else None


class Attention(nn.Module):
    def __init__(self, a, mp, rpe=None):
        super().__init__()
        h = a["hidden_size"]
        heads = a["num_attention_heads"]
        np_ = divide(heads, mp)
        hn = divide(h, heads)
        if a.get("use_qk_layernorm"):
            self.qk_layernorm = norm_module(a["norm"], [np_, hn])
        kv = a.get("num_kv_heads") or heads
        if kv == heads:
            out = 3 * h
        else:
            divide(kv, mp)
            out = h + 2 * kv * hn
        self.query_key_value = Column(h, out, mp, a["use_bias_in_attn_linear"])
        self.rpe = rpe
        self.dense = Row(h, h, mp, a["use_bias_in_attn_linear"])


class MLP(nn.Module):
    def __init__(self, a, mp, multiple_of):
        super().__init__()
        h = a["hidden_size"]
        if a.get("intermediate_size"):
            ffn_dim = a["intermediate_size"]
        elif a.get("expansion_factor"):
            ffn_dim = int(a["expansion_factor"] * h)
        else:
            ffn_dim = 4 * h
        ffn_dim_in = ffn_dim
        if a["activation"] in ("geglu", "reglu", "swiglu", "bilinear", "glu"):
            ffn_dim = int(ffn_dim * 2 / 3)
            ffn_dim_in = ffn_dim // 2
        ffn_dim = int((2 * multiple_of) * ((ffn_dim + (2 * multiple_of) - 1) // (2 * multiple_of)))
        ffn_dim_in = int(multiple_of * ((ffn_dim_in + multiple_of - 1) // multiple_of))
        self.linear1 = Column(h, ffn_dim, mp, a["use_bias_in_mlp"])
        self.linear2 = Row(ffn_dim_in, h, mp, a["use_bias_in_mlp"])


class TransformerLayer(nn.Module):
    def __init__(self, a, mp, rpe=None):
        super().__init__()
        self.input_layernorm = norm_module(a["norm"], a["hidden_size"])
        self.attention = Attention(a, mp, rpe)
        self.post_attention_layernorm = norm_module(a["norm"], a["hidden_size"])
        self.mlp = MLP(a, mp, a["mlp_multiple_of"])


class RPE(nn.Module):
    def __init__(self, a, mp):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(a["rpe_num_buckets"],
                                               divide(a["num_attention_heads"], mp), **META))


class Embedding(nn.Module):
    def __init__(self, a, mp, vocab):
        super().__init__()
        self.word_embeddings = nn.Module()
        self.word_embeddings.weight = nn.Parameter(torch.empty(divide(vocab, mp), a["hidden_size"],
                                                               **META))
        if a["pos_emb"] == "learned":
            self.position_embeddings = nn.Embedding(a["max_position_embeddings"], a["hidden_size"],
                                                    **META)


class NormPipe(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.norm = norm_module(a["norm"], a["hidden_size"])


class Head(nn.Module):
    def __init__(self, a, mp, vocab):
        super().__init__()
        self.final_linear = Column(a["hidden_size"], vocab, mp, bias=False)


def build_specs(a, mp, vocab):
    """(name, module factory) per spec, like GPT2ModelPipe.init_specs."""
    rpe = RPE(a, mp) if a["pos_emb"] == "rpe" else None
    tied = not a["no_weight_tying"]
    specs = [("embed", lambda: Embedding(a, mp, vocab)), ("fn", None)]
    for _ in range(a["num_layers"]):
        specs.append(("layer", lambda: TransformerLayer(a, mp, rpe)))
    specs += [("fn", None), ("norm", lambda: NormPipe(a))]
    specs.append(("embed", lambda: Embedding(a, mp, vocab)) if tied else
                 ("head", lambda: Head(a, mp, vocab)))
    return specs


def stage_numel(specs, start, stop):
    """Like PipelineModule._build: a tied key builds one module per stage; rpe is shared."""
    modules = nn.ModuleList()
    built_embed = False
    for kind, factory in specs[start:stop]:
        if factory is None:
            continue
        if kind == "embed":
            if built_embed:
                continue
            built_embed = True
        modules.append(factory())
    return sum(p.numel() for p in modules.parameters())


CASES = [
    dict(),
    dict(pos_emb="rotary", no_weight_tying=True, gpt_j_residual=True),
    dict(num_kv_heads=4, pos_emb="rotary", use_bias_in_attn_linear=False),
    dict(activation="swiglu", intermediate_size=512, mlp_multiple_of=32, norm="rmsnorm",
         use_bias_in_attn_linear=False, use_bias_in_mlp=False, no_weight_tying=True),
    dict(activation="geglu", expansion_factor=3.0, mlp_multiple_of=16, norm="scalenorm"),
    dict(pos_emb="rpe", rpe_num_buckets=16, use_qk_layernorm=True),
    dict(norm="non_parametric_layernorm", pos_emb="alibi", use_qk_layernorm=True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mp,pp", [(1, 1), (2, 2), (4, 3)])
def test_stage_params_match_torch(case, mp, pp):
    base = dict(num_layers=5, hidden_size=128, num_attention_heads=8, seq_length=64,
                max_position_embeddings=64)
    cfg = make_config(**dict(base, **case), pipe_parallel_size=pp, model_parallel_size=mp,
                      world_size=pp * mp)
    d = derive(cfg, 1000)
    a = dict(vars(cfg.model))
    specs = build_specs(a, mp, d.padded_vocab)
    for layer, (kind, factory) in zip(d.layers, specs):
        alone = 0 if factory is None else sum(p.numel() for p in factory().parameters())
        assert layer.params == alone, layer
    for stage in d.stages:
        assert stage.params_per_rank == stage_numel(specs, stage.start, stage.stop), stage.index
