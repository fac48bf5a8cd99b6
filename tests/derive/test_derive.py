import subprocess
import sys

import pytest

from neox_perf.derive import DeriveError, PartitionError, derive

from derive_specs import RAW_VOCAB_20B, make_config


def test_20b_summary(neox20b):
    d = derive(neox20b, RAW_VOCAB_20B, 40 * 2 ** 30)
    assert d.parts == (0, 13, 25, 36, 49)
    assert [s.transformer_layers for s in d.stages] == [11, 12, 11, 10]
    assert d.params.per_rank_max == max(s.params_per_rank for s in d.stages)
    assert sum(s.unique_params for s in d.stages) == d.params.unique
    assert d.warnings == ()
    hash(d)  # frozen all the way down


def test_options_from_values():
    from neox_perf.derive import DeriveOptions
    o = DeriveOptions.from_values({"zero_optimization": {"stage": 1}, "hidden_dropout": 0.1,
                                   "optimizer": {"type": "sgd", "params": {"momentum": 0.9}},
                                   "data_types": {"grad_accum_dtype": "FP32"}})
    assert o.contiguous_gradients  # DeepSpeed's default when the dict omits it
    assert o.hidden_dropout == 0.1 and o.optimizer_momentum == 0.9 and o.grad_accum_dtype == "fp32"
    assert not DeriveOptions.from_values({}).contiguous_gradients  # NeoX's ZERO_DEFAULTS
    with pytest.raises(DeriveError):
        DeriveOptions.from_values({"hidden_dropout": "lots"})


def test_no_heavy_imports():
    code = ("import sys, neox_perf.derive; "
            "bad = [m for m in ('torch', 'numpy', 'deepspeed') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pp0_is_one_stage_one_micro_batch():
    d = derive(make_config(pipe_parallel_size=0, gradient_accumulation_steps=8), 100)
    assert len(d.stages) == 1 and d.stages[0].memory.micro_batches_in_flight == 1


def test_errors_are_value_errors():
    with pytest.raises(PartitionError):
        derive(make_config(num_layers=1, pipe_parallel_size=8, world_size=8), 100)
    with pytest.raises(DeriveError):
        derive(make_config(hidden_size=64, num_attention_heads=4, model_parallel_size=8,
                           world_size=8), 100)
    with pytest.raises(ValueError):
        derive(make_config(pipe_partition_method="type:nothing"), 100)


def test_refuses_gated_width_mismatch_and_zero_param_stage():
    """Both stop NeoX (a matmul at the first forward; an optimizer over no parameters): errors
    of neox_perf.refusals, not derive warnings."""
    from neox_perf.refusals import config_refusals, derived_refusals
    cfg = make_config(hidden_size=4096, num_attention_heads=32, activation="swiglu",
                      intermediate_size=14336)
    d = derive(cfg, 100)
    assert [v.code for v in config_refusals(cfg)] == ["gated_mlp_width"]
    assert "linear1 gives 2 x 4779" in config_refusals(cfg)[0].message
    assert not derived_refusals(cfg, d) and not any("linear1" in w for w in d.warnings)
    # uniform over 6 layer specs in 5 stages: stage 2 gets only _post_transformer_block
    cfg = make_config(num_layers=1, pipe_parallel_size=5, world_size=5, pipe_partition_method="uniform")
    d = derive(cfg, 100)
    assert [s.params_per_rank == 0 for s in d.stages] == [False, False, True, False, False]
    refused = derived_refusals(cfg, d)
    assert [(v.code, v.level) for v in refused] == [("stage_without_parameters", "error")]
    assert "stage 2 holds no parameters (_post_transformer_block)" in refused[0].message
    assert not config_refusals(cfg)


def test_with_config_loader(neox_configs):
    from neox_perf import config as config_pkg
    raw = config_pkg.load_files([str(neox_configs / "20B.yml")])
    cfg, _verdicts, _warnings = config_pkg.build(raw, config_pkg.WorldRequest(gpus=96))
    d = derive(cfg, RAW_VOCAB_20B)
    assert d.params.unique == 20_554_567_680
    assert d.params.neox_logged == 20_556_201_984
    assert d.options.contiguous_gradients  # the 20B config sets it
