"""In-flight activations under DeepSpeed's 1F1B are what the engine keeps, no more: the real
PipelineEngine at a deep pipeline with many micro-batches in flight, measured with the
live-bytes tracker (calibration/live_memory.py, the hook's third iteration), against
derive/memory.py per stage and per component.

  pp 8, 16 micro-batches      stage s keeps min(pp - s, gas) micro-batches: 8 on the first,
                              1 on the last; each keeps its received input twice (the slot's
                              clone and the forward's clone, tp 1)
  pp 4 x mp 2, 8 micro-batches  DeepSpeed partitions what a stage sends over the tensor-parallel
                              ranks (is_pipe_partitioned): the later stage rebuilds the full
                              activation into its slot and runs the forward on that tensor (one
                              copy per micro-batch in flight, not two), a non-last stage keeps
                              only its output's partition for every micro-batch in flight, and
                              the persistent receive buffer is a partition too. The 39B layout
                              (tp 8, pp 16) was refused on these two terms (docs/memory.md).

Tiny shapes (8 ranks each on CPU + gloo, ~40 s warm each). The workload's own data tensors
("other", its synthetic batches) are not NeoX's and are left out, as in test_memory_measured.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from workload_specs import write_config  # noqa: E402

VOCAB = 500
EXACT = 0.001  # of the stage's peak, every component but the workload's own data
STAGE = 0.01
SHAPES = dict(num_layers=16, hidden_size=64, num_attention_heads=4, seq_length=32,
              max_position_embeddings=32, pos_emb="learned", norm="layernorm",
              train_micro_batch_size_per_gpu=2, precision="fp32")
LAYOUTS = {
    "pp8": dict(pipe_parallel_size=8, model_parallel_size=1, gradient_accumulation_steps=16),
    "pp4-mp2": dict(pipe_parallel_size=4, model_parallel_size=2, gradient_accumulation_steps=8),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def measured(request, tmp_path_factory):
    from neox_perf.calibration.launch import CACHING_MALLOC_ENV, free_port
    from neox_perf.runs import files as runfiles
    from neox_perf.runs import prediction
    name = request.param
    work = tmp_path_factory.mktemp(name)
    cfg = write_config(work / f"{name}.yml", **SHAPES, **LAYOUTS[name])
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "neox_perf", "run", "--run-dir", str(run_dir), "--windows", "off",
           "--", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "8",
           "--master_port", str(free_port()), "-m", "neox_perf.calibration.workload.train",
           "--config", cfg, "--iters", "3", "--vocab-size", str(VOCAB),
           "--out", str(work / "result.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **CACHING_MALLOC_ENV}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = runfiles.read_rank_summaries(str(run_dir))
    _, derived, notes = prediction.rebuild(summaries[0]["config"], summaries[0]["facts"])
    assert derived is not None, notes
    return name, summaries, derived


def _stages(summaries):
    from neox_perf.runs.memory import live_of
    out = {}
    for s in summaries:
        live = live_of(s)
        stage = int(s["facts"].get("stage") or 0)
        if live is not None and stage not in out:
            out[stage] = live
    return out


def test_every_stage_and_component_is_what_the_engine_keeps(measured):
    name, summaries, derived = measured
    stages = _stages(summaries)
    pp = LAYOUTS[name]["pipe_parallel_size"]
    assert sorted(stages) == list(range(pp))
    for stage, live in stages.items():
        mem = derived.stages[stage].memory
        total = live["peak_bytes"]
        assert abs(mem.total - total) <= STAGE * total, (name, stage, mem.total, total)
        for comp, m in live["at_peak"].items():
            if comp == "other":
                continue
            slack = EXACT * total
            if comp in ("temporaries", "activations") and LAYOUTS[name]["model_parallel_size"] > 1:
                # one more activation-sized tensor is alive at the peak in some runs and not in
                # others (2 of 4 runs of the same pp 4 x mp 2 layout as a temporary; in a CI run
                # one fewer among the activations, the stage total within STAGE all the same): a
                # rebuilt partition whose release races the measurement
                slack += 2 * 32 * 64 * 4  # micro-batch x seq x hidden x fp32
            assert abs(mem.peak[comp] - m) <= slack, (name, stage, comp, mem.peak[comp], m)


def test_in_flight_is_one_f_one_b(measured):
    """Stage s holds pp - s micro-batches at its first backward (DeepSpeed's TrainSchedule),
    and the measured activations say so: between two stages holding the same blocks they
    differ by one micro-batch's worth per micro-batch in flight."""
    name, summaries, derived = measured
    pp, gas = LAYOUTS[name]["pipe_parallel_size"], LAYOUTS[name]["gradient_accumulation_steps"]
    assert gas >= 2 * pp
    stages = _stages(summaries)
    for s in range(pp):
        assert derived.stages[s].memory.micro_batches_in_flight == min(pp - s, gas)
    same = [s for s in range(1, pp - 3) if derived.stages[s].layer_names
            == derived.stages[s + 1].layer_names == derived.stages[s + 2].layer_names]
    if pp < 8:
        return  # too shallow for three alike middle stages
    assert same, [d.layer_names for d in derived.stages]
    s = same[0]
    acts = [stages[s + i]["at_peak"]["activations"] for i in range(3)]
    assert acts[0] - acts[1] == acts[1] - acts[2] > 0  # one micro-batch's worth per stage
