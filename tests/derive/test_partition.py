"""Pipeline partitioning (pure Python); DeepSpeed equality lives in test_partition_deepspeed.py."""
import pytest

from neox_perf.derive import (PartitionError, build_layers, derive, partition, partition_balanced,
                              partition_uniform)

from derive_specs import RAW_VOCAB_20B, make_config, with_parallel


def closed_form(n_layers, pp):
    """The notes' closed form for type:transformer|mlp on N+5 specs (W = N + 2 weighted)."""
    q, r = divmod(n_layers + 2, pp)
    weights = [q + 1 if s < r else q for s in range(pp)]
    return [w - (s == 0) - (s == pp - 1) for s, w in enumerate(weights)]


def blocks_per_stage(d):
    return [s.transformer_layers for s in d.stages]


@pytest.mark.parametrize("pp,expected", [(1, [44]), (2, [22, 22]), (4, [11, 12, 11, 10]),
                                         (8, [5, 6, 6, 6, 6, 6, 5, 4])])
def test_20b_partition(neox20b, pp, expected):
    d = derive(with_parallel(neox20b, pipe_parallel_size=pp, data_parallel_size=1,
                             world_size=pp * 2), RAW_VOCAB_20B)
    assert blocks_per_stage(d) == expected
    assert d.parts[0] == 0 and d.parts[-1] == 49
    # Embedding on the first stage; norm + head on the last.
    assert d.stages[0].layer_names[:2] == ("EmbeddingPipe", "_pre_transformer_block")
    assert d.stages[-1].layer_names[-3:] == ("_post_transformer_block", "NormPipe",
                                             "ParallelLinearPipe")


def test_20b_pp4_parts(neox20b):
    assert derive(neox20b, RAW_VOCAB_20B).parts == (0, 13, 25, 36, 49)


@pytest.mark.parametrize("n,pp,expected", [(44, 4, [11, 12, 11, 10]), (32, 4, [8, 9, 8, 7]),
                                           (32, 8, [4, 5, 4, 4, 4, 4, 4, 3]), (12, 2, [6, 6]),
                                           (80, 8, [10, 11, 10, 10, 10, 10, 10, 9])])
def test_notes_examples(n, pp, expected):
    cfg = make_config(num_layers=n, pipe_parallel_size=pp, world_size=pp)
    assert blocks_per_stage(derive(cfg, 100)) == expected


def test_closed_form_holds():
    for n in range(1, 90):
        layers = build_layers(make_config(num_layers=n).model, 1, 128)
        for pp in range(2, 17):
            if n + 2 < pp:  # fewer weighted specs than stages: DeepSpeed puts some on 0 layers
                continue
            parts = partition(layers, pp, "type:transformer|mlp")
            counts = [sum(1 for l in layers[parts[s]:parts[s + 1]] if l.is_block)
                      for s in range(pp)]
            assert counts == closed_form(n, pp), (n, pp)


def test_uniform_counts_all_specs():
    layers = build_layers(make_config(num_layers=44).model, 1, 128)
    assert partition(layers, 4, "uniform") == [0, 13, 25, 37, 49]  # 13, 12, 12, 12 specs
    assert partition(layers, 4, "UNIFORM") == [0, 13, 25, 37, 49]


def test_parameters_method_balances_weights():
    cfg = make_config(num_layers=8, hidden_size=64, pos_emb="learned", no_weight_tying=True)
    layers = build_layers(cfg.model, 1, 50304)
    # The embedding and the head (50304 x 64 each) outweigh all 8 layers together, so each gets
    # a stage of its own and the middle stage takes every transformer layer.
    assert partition(layers, 3, "parameters") == [0, 2, 12, 13]
    assert partition(layers, 3, "type:transformer|mlp") == [0, 5, 8, 13]


def test_uniform_helpers():
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_balanced([1], 3) == [0, 1, 1, 1]


def test_balanced_row_at_a_time_equals_state_by_state(monkeypatch):
    """The numpy DP (a row of states at once) and the Python one (state by state) cut alike:
    whole and fractional weights, zeros, ties, as many stages as items and more."""
    import importlib
    import random
    part = importlib.import_module("neox_perf.derive.partition")  # derive exports partition()
    rng = random.Random(0)
    cases = 0
    for _ in range(150):
        n = rng.randint(2, 70)
        kind = rng.choice(("binary", "small", "float", "large"))
        weights = [{"binary": lambda: rng.choice([0, 0, 1]), "small": lambda: rng.randint(0, 9),
                    "float": lambda: rng.random() * 10,
                    "large": lambda: rng.choice([0, 7, 3 * 10 ** 8, 10 ** 9])}[kind]()
                   for _ in range(n)]
        for m in range(1, n + 2):
            monkeypatch.setattr(part, "_VECTORISE_ABOVE", 10 ** 18)
            by_state = part._balanced.__wrapped__(tuple(weights), m)
            monkeypatch.setattr(part, "_VECTORISE_ABOVE", -1)
            assert part._balanced.__wrapped__(tuple(weights), m) == by_state, (weights, m)
            cases += 1
    assert cases > 4000


def test_balanced_memo_hands_out_copies():
    """partition_balanced is memoised: a caller changing its answer changes no later one."""
    weights = [0, 1, 1, 1, 1, 1, 1, 0]
    first = partition_balanced(weights, 3)
    first[1] = 99
    assert partition_balanced(list(weights), 3) == [0, 3, 5, 8]
    assert partition_balanced(weights, 3) is not partition_balanced(weights, 3)


@pytest.mark.parametrize("method", ["profile", "random", "type", "parameter"])
def test_unknown_method(method):
    layers = build_layers(make_config().model, 1, 128)
    with pytest.raises(PartitionError):
        partition(layers, 2, method)


def test_no_match_and_bad_regex():
    layers = build_layers(make_config().model, 1, 128)
    with pytest.raises(PartitionError, match="matches no layer"):
        partition(layers, 2, "type:attention")
    with pytest.raises(PartitionError, match="invalid regex"):
        partition(layers, 2, "type:(")
    with pytest.raises(ValueError):  # PartitionError is a ValueError
        partition(layers, 2, "type:attention")


def test_more_stages_than_specs():
    layers = build_layers(make_config(num_layers=1).model, 1, 128)  # 6 specs
    with pytest.raises(PartitionError, match="would get no layers"):
        partition(layers, 8, "type:transformer|mlp")
    with pytest.raises(PartitionError):
        partition(layers, 0, "uniform")


def test_error_is_one_line():
    layers = build_layers(make_config(num_layers=1).model, 1, 128)
    with pytest.raises(PartitionError) as info:
        partition(layers, 8, "uniform")
    assert "\n" not in str(info.value)


def test_type_regex_matches_functions():
    layers = build_layers(make_config(num_layers=3).model, 1, 128)
    parts = partition(layers, 5, "type:transformer")
    # 5 weighted specs (2 functions + 3 layers) over 5 stages: one each.
    weighted = [l.index for l in layers if "transformer" in l.name.lower()]
    assert len(weighted) == 5
    for s in range(5):
        assert sum(1 for i in weighted if parts[s] <= i < parts[s + 1]) == 1


def test_mamba_warning_and_weights():
    cfg = make_config(num_layers=6, attention_types=("mamba",) * 6, pos_emb="none",
                      pipe_parallel_size=2, world_size=2)
    d = derive(cfg, 100)
    assert any("do not match" in w for w in d.warnings)
