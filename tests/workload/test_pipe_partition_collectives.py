"""DeepSpeed's real PipelineEngine with tensor parallelism, pp 2 x mp 2 = 4 ranks on CPU + gloo:
the communication it makes in a train_batch, recorded in the ranks
(record_engine_collectives.py), is what the decomposition prices.

With model parallelism the engine partitions the activation and the gradient it sends between
stages over the tensor-parallel ranks and all-gathers them where they are used
(operators._partition_allgathers): the decomposition's pp_allgather calls must be exactly the
engine's all_gather_into_tensor calls -- instruction, count, group and elements per rank --
and its p2p elements the partitions the engine sends. One launch (~15 s warm).
"""
import collections
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from workload_specs import VOCAB, write_config  # noqa: E402

HERE = Path(__file__).resolve().parent
WORLD, PP, MP, GAS, ITERS = 4, 2, 2, 3, 2
# the decomposition's phases and the engine instruction that runs them
INSTRUCTION = {"fwd": "ForwardPass", "bwd": "BackwardPass"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from neox_perf.calibration.launch import launch, rank_env
    workdir = tmp_path_factory.mktemp("pp2mp2")
    cfg = write_config(workdir / "pp2mp2.yml", pipe_parallel_size=PP, model_parallel_size=MP,
                       gradient_accumulation_steps=GAS, gradient_clipping=0.0)
    record = workdir / "record"
    env = {k: v for k, v in rank_env("cpu").items()
           if not k.startswith("PYTHON_NEOX_PERF_") and k != "NEOX_PERF_CLUSTER"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
           "--master_port", "0", str(HERE / "record_engine_collectives.py"),
           "--record", str(record), "--config", cfg, "--iters", str(ITERS),
           "--vocab-size", str(VOCAB), "--out", str(workdir / "out.json")]
    launch(cmd, env, workdir / "launch.log", cwd=workdir, timeout_s=900, what="pp 2 x mp 2 workload")
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return cfg, ranks, json.loads((workdir / "out.json").read_text())


@pytest.fixture(scope="module")
def decomp(run):
    from neox_perf import derive
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.prediction.operators import decompose, stage_shapes
    cfg, _, _ = build(load_files([run[0]]), WorldRequest(gpus=WORLD))
    d = derive.derive(cfg, VOCAB)
    assert list(d.parts) == run[2]["layout"]["parts"]  # the stages the engine built
    return decompose(cfg, d.padded_vocab, stage_shapes(d), precision=run[2]["training"]["precision_run"])


def steady(rank):
    """The last train_batch: the first one also sends the one-off p2p shape header."""
    assert len(rank["iterations"]) == ITERS
    return rank["iterations"][-1]


def test_every_rank_recorded_its_stage(run):
    _, ranks, out = run
    assert out["layout"]["num_stages"] == PP and out["layout"]["model_parallel_size"] == MP
    # DeepSpeed's rank order: model innermost, then data, then pipe
    assert [r["stage"] for r in ranks] == [0, 0, 1, 1]


def test_partition_all_gathers_are_the_engines(run, decomp):
    _, ranks, _ = run
    m = decomp.micro_batches
    assert m == GAS
    for rank in ranks:
        work = decomp.stages[rank["stage"]]
        expected = collections.Counter()
        for c in (*work.forward, *work.backward):
            if getattr(c, "purpose", None) == "pp_allgather":
                expected[(INSTRUCTION[c.phase], c.nodes * c.gpus_per_node, c.elements)] += c.count * m
        calls = [c for c in steady(rank) if c["op"] in ("all_gather_into_tensor", "all_gather")]
        got = collections.Counter((c["phase"], len(c["group"]), float(c["numel"])) for c in calls)
        assert got == expected, (rank["rank"], got, expected)
        assert got  # pp 2 x mp 2: every stage gathers (stage 0 in backward, stage 1 in forward)
        for c in calls:
            # the tensor-parallel ranks, adjacent: the group group_placement(mp, 1, ...) places
            assert c["op"] == "all_gather_into_tensor"
            assert c["group"] == list(range(c["group"][0], c["group"][0] + MP))
            assert rank["rank"] in c["group"]


def test_partitions_sent_are_the_p2p_elements(run, decomp):
    _, ranks, _ = run
    m = decomp.micro_batches
    for rank in ranks:
        work = decomp.stages[rank["stage"]]
        for instr, call in (("SendActivation", work.send_activation), ("SendGrad", work.send_gradient)):
            sends = [c for c in steady(rank) if c["op"] == "send" and c["phase"] == instr]
            if call is None:
                assert not sends
                continue
            # per micro-batch: the partition meta (int64), this rank's chunk, and on the way
            # forward NeoX's attention mask, cast to fp16 (priced with the send, in elements of
            # the run's dtype: this run computes in fp32)
            chunks = [c for c in sends if c["dtype"] == "float32"]
            masks = [c for c in sends if c["dtype"] == "float16"]
            assert len(chunks) == m and len(masks) == (m if instr == "SendActivation" else 0)
            mask = masks[0]["numel"] / 2 if masks else 0
            assert {c["numel"] + mask for c in chunks} == {call.elements}
            meta = [c for c in sends if c["dtype"] == "int64"]
            assert len(meta) == m and all(c["numel"] < 16 for c in meta)


def test_nothing_else_is_gathered_or_broadcast(run):
    # beyond the partitions: one loss broadcast over the pipe group at the end of train_batch
    # (the timeline's end-of-batch barrier), no other all-gather or broadcast
    _, ranks, _ = run
    for rank in ranks:
        calls = steady(rank)
        other = [c for c in calls if c["op"] in ("all_gather_into_tensor", "all_gather")
                 and c["phase"] not in INSTRUCTION.values()]
        assert not other
        casts = [c for c in calls if c["op"] == "broadcast"]
        assert len(casts) == 1 and casts[0]["numel"] <= 4 and casts[0]["phase"] == "train_batch"
        assert len(casts[0]["group"]) == PP
