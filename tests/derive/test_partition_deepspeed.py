"""Our partitioning == DeepSpeed's own _partition_layers, _find_layer_type, partition_balanced
and partition_uniform, run on real LayerSpec / TiedLayerSpec objects."""
import types

import pytest

deepspeed = pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from deepspeed.pipe import LayerSpec, TiedLayerSpec  # noqa: E402
from deepspeed.runtime.pipe.module import PipelineModule  # noqa: E402
from deepspeed.runtime.utils import partition_balanced as ds_balanced  # noqa: E402
from deepspeed.runtime.utils import partition_uniform as ds_uniform  # noqa: E402

from neox_perf.derive import (PartitionError, build_layers, find_layer_type, partition,  # noqa: E402
                              partition_balanced, partition_uniform)

from derive_specs import make_config  # noqa: E402


def _module_class(name):
    def __init__(self, numel=0, *args, **kwargs):
        torch.nn.Module.__init__(self)
        if numel:
            # meta tensors: DeepSpeed counts numel() without allocating 20B-sized layers
            self.weight = torch.nn.Parameter(torch.empty(numel, device="meta"))
    return type(name, (torch.nn.Module,), {"__init__": __init__})


CLASSES = {n: _module_class(n) for n in (
    "EmbeddingPipe", "ParallelTransformerLayerPipe", "GMLPBlock", "RWKVResidualLayerPipe",
    "ParallelMambaResidualLayerPipe", "NormPipe", "ParallelLinearPipe")}


def _pre_transformer_block(args):  # names matter: DeepSpeed matches function __name__
    return args


def _post_transformer_block(args):
    return args


FUNCTIONS = {"_pre_transformer_block": _pre_transformer_block,
             "_post_transformer_block": _post_transformer_block}


def _logits_helper(embedding, lm_output):
    return lm_output


def ds_specs(layers):
    specs = []
    for layer in layers:
        if layer.is_function:
            specs.append(FUNCTIONS[layer.name])
        elif layer.tied_key is not None:
            kw = {"forward_fn": _logits_helper} if layer.kind == "head" else {}
            specs.append(TiedLayerSpec(layer.tied_key, CLASSES[layer.name], layer.params,
                                       tied_weight_attr="weight", **kw))
        else:
            specs.append(LayerSpec(CLASSES[layer.name], layer.params))
    return specs


def ds_partition(specs, num_stages, method):
    """Run DeepSpeed's PipelineModule._partition_layers on a stub holding real layer specs."""
    stub = types.SimpleNamespace(
        num_stages=num_stages, global_rank=1, _layer_specs=specs, loss_fn=None,
        _topo=types.SimpleNamespace(get_coord=lambda rank: types.SimpleNamespace(pipe=0)),
        _set_bounds=lambda start=None, stop=None: None)
    stub._find_layer_type = types.MethodType(PipelineModule._find_layer_type, stub)
    stub._count_layer_params = types.MethodType(PipelineModule._count_layer_params, stub)
    PipelineModule._partition_layers(stub, method=method)
    return [int(p) for p in stub.parts]


def ours_or_none(layers, num_stages, method):
    try:
        return partition(layers, num_stages, method)
    except PartitionError:
        return None


def check(layers, num_stages, method, specs=None):
    ds = ds_partition(specs or ds_specs(layers), num_stages, method)
    ours = ours_or_none(layers, num_stages, method)
    if ours is None:
        # We refuse only where DeepSpeed leaves a stage without any layer.
        assert any(ds[s + 1] <= ds[s] for s in range(num_stages)), (method, num_stages, ds)
    else:
        assert ours == ds, (method, num_stages, ours, ds)


def test_find_layer_type_semantics():
    cfg = make_config(num_layers=6, attention_types=("global", "gmlp", "mamba", "rwkv", "flash",
                                                     "amlp"), pos_emb="none")
    layers = build_layers(cfg.model, 1, 128)
    stub = types.SimpleNamespace(_layer_specs=ds_specs(layers))
    names = [l.name for l in layers]
    for regex in ("transformer|mlp", "transformer", "mlp", "embedding", "pipe", "^_", "norm|linear",
                  "LAYER", "block$", "Mamba|RWKV"):
        assert find_layer_type(names, regex) == PipelineModule._find_layer_type(stub, regex), regex
    with pytest.raises(RuntimeError):
        PipelineModule._find_layer_type(stub, "attention")
    with pytest.raises(PartitionError):
        find_layer_type(names, "attention")


def test_grid_type_and_uniform():
    for n in range(1, 81):
        # tied and untied heads alternate: both end in a spec the default regex does not match
        layers = build_layers(make_config(num_layers=n, no_weight_tying=n % 2 == 1).model, 1, 128)
        specs = ds_specs(layers)
        for pp in range(1, 17):
            check(layers, pp, "type:transformer|mlp", specs)
            check(layers, pp, "uniform", specs)


def test_grid_parameters():
    for n in range(1, 81):
        # untied with learned positions and a large vocab, so the weights are far from uniform
        cfg = make_config(num_layers=n, hidden_size=64, pos_emb="learned", no_weight_tying=n % 2 == 0)
        layers = build_layers(cfg.model, 1, 50304)
        specs = ds_specs(layers)
        for pp in range(1, 17):
            check(layers, pp, "parameters", specs)


def test_20b_shapes_parameters_method(neox20b):
    for mp in (1, 2, 4):
        layers = build_layers(neox20b.model, mp, 50432 if mp <= 2 else 50688)
        specs = ds_specs(layers)
        for pp in (1, 2, 4, 8, 16):
            check(layers, pp, "parameters", specs)
            check(layers, pp, "type:transformer|mlp", specs)


def test_mixed_blocks_and_other_regexes():
    cfg = make_config(num_layers=12, attention_types=("global", "gmlp", "mamba") * 4, pos_emb="rpe")
    layers = build_layers(cfg.model, 1, 128)
    specs = ds_specs(layers)
    for pp in range(1, 10):
        for method in ("type:transformer|mlp", "type:mlp", "type:Pipe", "type:mamba|gmlp",
                       "parameters", "uniform"):
            check(layers, pp, method, specs)


def test_balanced_and_uniform_helpers_random():
    import random
    rng = random.Random(0)
    for _ in range(400):
        n, m = rng.randint(1, 40), rng.randint(1, 12)
        weights = [rng.choice([0, 1, 1, 2, 7, rng.randint(0, 10 ** 9)]) for _ in range(n)]
        assert partition_balanced(weights, m) == [int(x) for x in ds_balanced(weights, m)]
        assert partition_uniform(n, m) == [int(x) for x in ds_uniform(n, m)]


def test_large_models_cut_in_many_stages():
    """Past _VECTORISE_ABOVE the DP runs a row at a time in numpy: GPT-NeoX 175B-sized layer
    lists (96 blocks) cut into up to 64 stages, and random weights as large."""
    import random
    from neox_perf.derive.partition import _VECTORISE_ABOVE
    cfg = make_config(num_layers=96, hidden_size=1024, num_attention_heads=16)
    for mp in (1, 4):
        layers = build_layers(cfg.model, mp, 50304)
        specs = ds_specs(layers)
        for pp in (8, 16, 32, 48, 64):
            check(layers, pp, "parameters", specs)
            check(layers, pp, "type:transformer|mlp", specs)
    rng = random.Random(1)
    cases = 0
    while cases < 40:
        n, m = rng.randint(60, 110), rng.randint(4, 50)
        if m * (n - m + 1) ** 2 <= _VECTORISE_ABOVE:
            continue
        cases += 1
        weights = [rng.choice([0, 1, 1, 2, rng.randint(0, 10 ** 9)]) for _ in range(n)]
        assert partition_balanced(weights, m) == [int(x) for x in ds_balanced(weights, m)]
