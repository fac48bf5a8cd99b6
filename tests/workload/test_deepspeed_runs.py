"""Real 2-process runs of the workload on CPU + gloo, under the deepspeed launcher (pp2) and
torchrun (the rest: it starts ~2x faster, as it does not import deepspeed itself).

Each layout is launched once per module (~10 s warm; the very first DeepSpeed process on a
machine also JIT-compiles its shm_comm op, ~1 min, cached in ~/.cache/torch_extensions).
Gradient clipping is off so that the pipeline and tensor-parallel runs compute the same
function step after step (DeepSpeed's pipeline grad-norm skips replicated params on stages
> 0, so with clipping on they drift apart slightly).
"""
import json
import math
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from workload_specs import VOCAB, write_config  # noqa: E402

ITERS = 5
TIMEOUT = 900
MODULE = "neox_perf.calibration.workload.train"
LAYOUTS = {
    "pp2": dict(pipe_parallel_size=2, model_parallel_size=1),
    "mp2": dict(pipe_parallel_size=1, model_parallel_size=2),
    "zero1-dp2": dict(pipe_parallel_size=0, model_parallel_size=1,
                      zero_optimization={"stage": 1, "reduce_bucket_size": 100000,
                                         "allgather_bucket_size": 100000}),
}
LAUNCHER = {"pp2": "deepspeed", "mp2": "torchrun", "zero1-dp2": "torchrun"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(launcher, workdir, name, keys):
    for attempt in range(2):
        proc, out = _launch_once(launcher, workdir, name, keys)
        (workdir / f"{name}.{attempt}.log").write_text(proc.stdout + proc.stderr)
        # The free port can be taken between our probe and the rendezvous (other jobs on
        # the machine); that is the one failure worth a second try.
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stdout + proc.stderr:
            break
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _launch_once(launcher, workdir, name, keys):
    cfg = write_config(workdir / f"{name}.yml", gradient_clipping=0.0, **keys)
    out = workdir / f"{name}.json"
    port = str(_free_port())
    if launcher == "deepspeed":
        # `deepspeed` is this module's console script; -m avoids depending on PATH.
        head = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_nodes", "1",
                "--num_gpus", "2", "--master_port", port, "--module", MODULE]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", port, "-m", MODULE]
    cmd = head + ["--config", cfg, "--iters", str(ITERS), "--vocab-size", str(VOCAB),
                  "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True,
                          timeout=TIMEOUT)
    return proc, out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cache = {}

    def get(name, launcher=None):
        launcher = launcher or LAUNCHER[name]
        key = (name, launcher)
        if key not in cache:
            workdir = tmp_path_factory.mktemp(f"{name}-{launcher}")
            try:
                cache[key] = _launch(launcher, workdir, name, LAYOUTS[name])
            except AssertionError as exc:
                cache[key] = exc  # a failed layout fails its other tests without relaunching
        if isinstance(cache[key], AssertionError):
            raise cache[key]
        return cache[key]
    return get


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_trains_and_times_every_iteration(run, name):
    r = run(name)
    assert r["schema"] == "neox-perf.workload/1" and r["iters"] == ITERS
    assert len(r["losses"]) == ITERS and all(math.isfinite(x) for x in r["losses"])
    assert r["losses"][-1] < r["losses"][0]
    assert len(r["seconds_per_iter"]) == ITERS and all(t > 0 for t in r["seconds_per_iter"])
    assert [rk["rank"] for rk in r["ranks"]] == [0, 1]
    for rk in r["ranks"]:
        assert len(rk["seconds"]) == ITERS and all(t > 0 for t in rk["seconds"])
    assert r["device"]["type"] == "cpu" and r["training"]["precision_run"] == "fp32"
    assert r["threads"]["OMP_NUM_THREADS"] == "1"
    # the optimizer NeoX builds without apex: DeepSpeed's FusedAdam, here its CPU op
    assert r["optimizer"] == "FusedAdam"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_stage_boundaries_are_the_engines(run, name):
    lay = run(name)["layout"]
    parts = lay["parts"]
    assert [s["layers"] for s in lay["stages"]] == [[a, b] for a, b in zip(parts, parts[1:])]
    for rk in run(name)["ranks"]:  # each rank's PipelineModule bounds, as it built them
        assert rk["layers"] == lay["stages"][rk["stage"]]["layers"]
    from neox_perf import derive
    from neox_perf.config import WorldRequest, build, load_files
    cfg, _, _ = build(load_files(run(name)["config_files"]), WorldRequest(gpus=2))
    d = derive.derive(cfg, VOCAB)
    assert parts == list(d.parts)
    assert [s["params_per_mp_rank"][0] for s in lay["stages"]] == \
        [s.params_per_rank for s in d.stages]


def test_layouts_are_what_was_asked(run):
    pp2, mp2, z1 = run("pp2")["layout"], run("mp2")["layout"], run("zero1-dp2")["layout"]
    assert (pp2["engine"], pp2["num_stages"], pp2["data_parallel_size"]) == ("PipelineEngine", 2, 1)
    # type:transformer|mlp over [embed, pre, 4 x layer, post, norm, head]: 2 + 2 layers
    assert pp2["parts"] == [0, 4, 9]
    assert [s["transformer_layers"] for s in pp2["stages"]] == [2, 2]
    assert (mp2["engine"], mp2["model_parallel_size"]) == ("PipelineEngine", 2)
    p0, p1 = mp2["stages"][0]["params_per_mp_rank"]
    assert p0 == p1 and p0 < sum(s["params"] for s in pp2["stages"])
    assert (z1["engine"], z1["data_parallel_size"]) == ("DeepSpeedEngine", 2)
    assert z1["optimizer"] == "DeepSpeedZeroOptimizer"


def test_tensor_parallel_computes_the_same_function(run):
    # Same initial weights (drawn whole, then split) and same data: if a TP all-reduce were
    # missing or misplaced, forward (iteration 0) or backward (later iterations) would differ.
    a, b = run("pp2")["losses"], run("mp2")["losses"]
    assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


def test_same_seed_same_losses_bit_for_bit(run):
    again = run("pp2", launcher="torchrun")
    assert again["losses"] == run("pp2")["losses"]
    assert again["layout"]["parts"] == run("pp2")["layout"]["parts"]
