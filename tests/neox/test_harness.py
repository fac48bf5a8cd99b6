"""The NeoX-on-CPU harness offline: layouts, the YAML it writes, what it reads from a log."""
import json

import pytest
import yaml

from neox_perf.config import load_files
from neox_perf.testing import neox_cpu


def test_layouts_cover_what_the_issue_asks():
    lays = neox_cpu.LAYOUTS.values()
    assert {lay.pp for lay in lays} >= {0, 1, 2}
    assert any(lay.mp == 2 for lay in lays)
    assert any(lay.zero_stage == 1 for lay in lays)
    assert any(lay.checkpoint for lay in lays)
    assert any(lay.gas > 2 for lay in lays)
    assert {lay.pos_emb for lay in lays} >= {"rotary", "learned"}
    assert {lay.tied for lay in lays} == {True, False}
    assert all(lay.dp * max(lay.pp, 1) * lay.mp == lay.gpus for lay in lays)


@pytest.mark.parametrize("name", sorted(neox_cpu.LAYOUTS))
def test_written_config_is_a_neox_config_the_checker_reads(name, tmp_path):
    lay = neox_cpu.LAYOUTS[name]
    path = neox_cpu.write_config(lay, str(tmp_path), "/data/x_text_document")
    values = yaml.safe_load(open(path))
    assert values["distributed_backend"] == "gloo" and values["global_num_gpus"] == lay.gpus
    assert values["no_save_rng"] and values["eval_iters"] == 0
    raw = load_files([path])  # NeoX keys only: the checker warns on unknown ones
    assert raw.values["pipe_parallel_size"] == lay.pp
    assert raw.values["no_weight_tying"] is (not lay.tied)


def test_log_parsing():
    log = "\n".join([
        "[INFO] cmd = python -u -m deepspeed.launcher.launch x.py --deepspeed_config eyJhIjogMX0= "
        "--megatron_config eyJudW1fbGF5ZXJzIjogNH0=",
        " > number of parameters on model parallel rank 1: 1000",
        " > number of parameters on model parallel rank 0: 1200",
        " > total params: 2,200",
        "RANK=0 STAGE=0 LAYERS=4 [0, 4) STAGE_PARAMS=1200 (0.001M) TOTAL_PARAMS=2200",
        "RANK=1 STAGE=1 LAYERS=5 [4, 9) STAGE_PARAMS=1000 (0.001M) TOTAL_PARAMS=2200",
        " samples/sec: 1.0 | iteration        1/      12 | elapsed time per iteration (ms): 346.5 |"
        " learning rate: 5.0E-04 | lm_loss: 6.190843E+00 | number of skipped iterations:   0 |",
    ])
    run = neox_cpu.NeoxRun(layout=None, config="x.yml", log=log, returncode=0, seconds=1.0)
    neox_cpu.parse_log(run)
    assert run.logged_params == 2200 and run.rank_params == {0: 1200, 1: 1000}
    assert run.partition == [0, 4, 9] and run.stage_params == {0: 1200, 1: 1000}
    assert run.iteration_ms == [346.5] and run.log_losses == [6.190843]
    assert run.megatron_config == "eyJudW1fbGF5ZXJzIjogNH0="
    # without DeepSpeed's per-rank line: PipelineModule's "stage=i layers=k" on rank 0
    run = neox_cpu.NeoxRun(layout=None, config="x.yml", returncode=0, seconds=1.0,
                           log="stage=0 layers=4\n    0: EmbeddingPipe\nstage=1 layers=5\n")
    neox_cpu.parse_log(run)
    assert run.partition == [0, 4, 9]


def test_without_a_checkout_the_message_says_what_to_set(monkeypatch, tmp_path):
    monkeypatch.delenv(neox_cpu.SRC_ENV, raising=False)
    with pytest.raises(neox_cpu.NeoxUnavailable, match="NEOX_PERF_NEOX_SRC"):
        neox_cpu.neox_src()
    with pytest.raises(neox_cpu.NeoxUnavailable, match="not a GPT-NeoX checkout"):
        neox_cpu.neox_src(str(tmp_path))


def test_loss_records_are_read_per_iteration_and_rank(tmp_path):
    f = tmp_path / "l.jsonl"
    f.write_text("\n".join(json.dumps({"rank": r, "iteration": i, "loss": float(i).hex(),
                                       "seconds": 0.1}) for i in (1, 2) for r in (1, 0)))
    run = neox_cpu.NeoxRun(layout=None, config="x", log="", returncode=0, seconds=0)
    neox_cpu._read_losses(str(f), run)
    assert run.loss_series() == [float(1).hex(), float(2).hex()]
    assert run.step_seconds[0] == [0.1, 0.1]


def test_the_wrapper_imports_without_neox_or_torch():
    import importlib
    import sys
    mod = importlib.import_module("neox_perf.hooks.neox_train")
    assert callable(mod.main)
    assert "megatron" not in sys.modules  # NeoX is imported only when it runs


def test_neox_ranks_recycle_large_tensors_as_calibrate_does(monkeypatch):
    """The harness launches NeoX with the CPU allocator settings calibrate and validate run
    under (large tensors recycled from the heap, as a GPU's caching allocator does)."""
    from neox_perf.calibration.launch import CACHING_MALLOC_ENV
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")  # the harness's word wins
    env = neox_cpu._env("/nowhere")
    assert {k: env[k] for k in CACHING_MALLOC_ENV} == CACHING_MALLOC_ENV
    assert env["OMP_NUM_THREADS"] == "1" and env["DS_ACCELERATOR"] == "cpu"
