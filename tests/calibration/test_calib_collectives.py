import os
import shutil
import subprocess
import sys

import pytest

from neox_perf.calibration.collectives import (LaunchError, group_ranks, group_shapes,
                                               launch_layout, plan_jobs, torchrun_command)
from neox_perf.calibration.launch import free_port
from neox_perf.calibration.store import SampleStore


def test_group_shapes_cover_the_published_topologies():
    # 2 nodes of 4 GPUs: the samples' 1_2, 1_4, 2_1, 2_2, 2_4 files
    assert group_shapes(2, 4, "allreduce") == [(1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]
    assert group_shapes(2, 4, "p2p") == [(1, 2), (2, 1)]
    assert group_shapes(8, 1, "allgather") == [(2, 1), (4, 1), (8, 1)]
    assert group_shapes(1, 6, "allreduce") == [(1, 2), (1, 4), (1, 6)]
    assert group_shapes(1, 1, "allreduce") == []
    assert group_ranks((2, 2), 4) == [0, 1, 4, 5]
    assert group_ranks((2, 1), 4) == [0, 4]


def test_launch_layout_reads_torchrun_and_deepspeed_variables():
    assert launch_layout({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "4"}) == (5, 8, 1, 2, 4)
    assert launch_layout({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                          "LOCAL_SIZE": "1"}) == (0, 4, 0, 4, 1)
    with pytest.raises(LaunchError, match="torchrun"):
        launch_layout({})
    with pytest.raises(LaunchError, match="multiple"):
        launch_layout({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})


def test_jobs_are_the_same_on_every_rank():
    sizes = {"allreduce": (16, 256), "p2p": (16,)}
    jobs = plan_jobs(sizes, 1, 2)
    assert [j.label for j in jobs] == ["allreduce 1x2 elements=16", "allreduce 1x2 elements=256",
                                       "p2p 1x2 elements=16"]
    assert jobs[0].features == {"elements": 16, "nodes": 1, "gpus_per_node": 2}


def test_without_a_launcher_it_says_how_to_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-m", "neox_perf.calibration.collectives", "--store",
                          str(tmp_path / "s.sqlite"), "--sizes", "8"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if "neox-perf" in line]
    assert len(lines) == 1 and "torchrun" in lines[0] and "Traceback" not in out.stderr


def test_torchrun_two_processes_on_gloo(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    store = tmp_path / "coll.sqlite"
    cmd = torchrun_command(2, store, sizes=(16, 1024), master_port=free_port())
    cmd += ["--warmup", "1", "--repeats", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    with SampleStore(store) as s:
        rows = s.samples()
        got = {(r.op, r.phase, r.features["elements"], r.features["nodes"], r.features["gpus_per_node"])
               for r in rows}
        assert got == {(k, "comm", e, 1, 2) for k in ("allreduce", "allgather", "p2p") for e in (16, 1024)}
        assert all(r.repeats == 3 and r.seconds > 0 and r.dtype == "fp32" for r in rows)
        assert all(r.info["backend"] == "gloo" for r in rows)
        assert s.integrity_check() == "ok"
    # a second launch finds everything stored and measures nothing
    cmd[cmd.index("--master_port") + 1] = str(free_port())
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    with SampleStore(store) as s:
        assert len(s.samples()) == len(rows)
