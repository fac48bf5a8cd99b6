"""Published training runs on DGX A100 SuperPODs, predicted on the bundled `dgx-a100` description.

Nothing in the product was fitted on these runs: the description's operators are the Perlmutter
A100 samples, its collectives those samples scaled by its link description (8 x HDR200 per
node, NVSwitch), its step terms vTrain's. So these are predictions on a cluster nobody fitted
on, as a user would get them: each run is written as a GPT-NeoX config and checked with
`neox-perf check --json` (in-process), and the published time is compared with the point and the
80% interval.

Two sources (numbers as published; the per-iteration time of Table 1 derived, see below):
- MT-NLG 530B (Smith et al., arXiv 2201.11990, sec. 2.3-2.4): DeepSpeed's pipeline engine with
  Megatron's tensor slicing -- the engine NeoX runs -- on Selene (DGX A100 80GB); 105 layers,
  hidden 20480, 128 heads, sequence 2048, global batch 1920; 8-way tensor, 35-way pipeline;
  60.1, 50.2 and 44.4 s per iteration on 280, 350 and 420 nodes (stated).
- Megatron-LM's weak scaling (Narayanan et al., SC21, arXiv 2104.04473, Table 1): Megatron-LM's
  own engine and pipeline schedules on Selene, fp16, activation recomputation, sequence 2048,
  vocabulary 51,200. The table gives teraFLOP/s per GPU; the time per iteration is the paper's
  own count of a step's FLOPs (its Eq. 3, 96 B s l h^2 (1 + s/6h + V/16lh)) over GPUs x that
  rate. Not NeoX's engine: DeepSpeed's partitioning and 1F1B schedule are what is predicted.

Neither source states the micro-batch: each run is predicted at every candidate NeoX fits in
memory (`MICRO_BATCHES`), and the summary takes micro-batch 1 (the only one every run fits at)
with the candidates' range beside it.

Both engines gave every pipeline stage layers / pp transformer layers (Megatron-LM requires the
division; Megatron-DeepSpeed's GPTModelPipe partitions 'type:transformer' over a layer list
whose transposes are lambdas). NeoX's own layer list under its default 'type:transformer' also
weighs its _pre/_post_transformer_block functions, which splits 105 layers on 35 stages as
3, 4, 3, ..., 2: that is another job than the one timed, so each config names the layer class
(`devset.MEGATRON_PARTITION`, the partition benchmarks/endtoend.py's Megatron-DeepSpeed runs use).

    python benchmarks/published_runs.py [--cluster dgx-a100] [--json] [--write DIR]

--write DIR also writes each run's config at micro-batch 1 (DIR/<run>.yml), to check or plan it.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple

SEQ = 2048
SC21 = "Narayanan et al., SC21 (arXiv 2104.04473), Table 1"
MTNLG = "Smith et al. 2022 (arXiv 2201.11990), sec. 2.4"
MICRO_BATCHES = (1, 2, 4)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    engine: str  # whose training engine ran it
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    seconds: float  # per iteration: stated, or derived from the published rate (stated False)
    tflops: float  # the published teraFLOP/s per GPU
    stated: bool = True  # whether the source states the time (else derived from tflops)
    zero: int = 0
    vocab: int = 51200  # in the FLOP count (the padded vocabulary the paper counts)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def sc21_seconds(layers, hidden, gpus, batch, tflops, vocab=51200) -> float:
    """Narayanan et al.'s Eq. 3 (FLOPs of one step with recomputation) over the published rate."""
    flops = 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (gpus * tflops * 1e12)


# (billions, heads, hidden, layers, tp, pp, GPUs, batch, teraFLOP/s per GPU, aggregate petaFLOP/s)
SC21_TABLE = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 502.0),
)

RUNS: Tuple[Run, ...] = tuple(
    Run(f"MT-NLG 530B, {n} nodes", MTNLG, "DeepSpeed pipeline", 105, 20480, 128, 8, 35, 8 * n, 1920, s, tf, zero=1)
    for n, s, tf in ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113))
) + tuple(
    Run(f"Megatron-LM {b:g}B", SC21, "Megatron-LM", l, h, a, tp, pp, g, batch,
        sc21_seconds(l, h, g, batch, tf), tf, stated=False)
    for b, a, h, l, tp, pp, g, batch, tf, _agg in SC21_TABLE
)


def neox_config(run: Run, micro: int) -> Optional[dict]:
    """The run as a GPT-NeoX config at this micro-batch (None: the batch does not divide)."""
    from neox_perf.predictors.fitting.devset import MEGATRON_PARTITION
    if run.batch % (run.dp * micro):
        return None
    return {"pipe_parallel_size": run.pp, "model_parallel_size": run.tp, "num_layers": run.layers,
            "hidden_size": run.hidden, "num_attention_heads": run.heads, "seq_length": SEQ,
            "max_position_embeddings": SEQ, "norm": "layernorm", "pos_emb": "learned",
            "tokenizer_type": "GPT2BPETokenizer", "scaled_upper_triang_masked_softmax_fusion": True,
            "bias_gelu_fusion": True, "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4}},
            "zero_optimization": {"stage": run.zero},
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": run.batch // (run.dp * micro),
            "checkpoint_activations": True, "checkpoint_num_layers": 1,
            "fp16": {"enabled": True}, "train_iters": 100,
            "pipe_partition_method": MEGATRON_PARTITION}  # layers / pp a stage, as both engines ran


def check(config: dict, gpus: int, cluster: str, tmp: Path) -> dict:
    """`neox-perf check --json` on the config: its exit code, verdict and prediction."""
    from neox_perf.cli import main
    path = tmp / "run.yml"
    path.write_text(json.dumps(config))  # JSON is YAML: NeoX's loader reads it as such
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["check", str(path), "--gpus", str(gpus), "--cluster", cluster, "--json"])
    data = json.loads(out.getvalue())
    pred = data.get("prediction") or {}
    return {"exit_code": code, "verdict": (data.get("verdict") or {}).get("level"),
            "seconds": pred.get("iteration_seconds"), "interval": pred.get("interval_seconds"),
            "regime": pred.get("regime")}


def predicted(runs=RUNS, cluster: str = "dgx-a100", micro_batches=MICRO_BATCHES) -> List[dict]:
    """One row per run: the published time and, per micro-batch NeoX fits, the prediction."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            per_micro = {}
            for micro in micro_batches:
                config = neox_config(run, micro)
                if config is None:
                    continue
                got = check(config, run.gpus, cluster, Path(tmp))
                if got["seconds"] is not None:
                    got["error"] = got["seconds"] / run.seconds - 1
                    lo, hi = got["interval"] or (None, None)
                    got["inside"] = lo is not None and lo <= run.seconds <= hi
                per_micro[micro] = got
            rows.append({"run": asdict(run), "dp": run.dp, "predicted": per_micro})
    return rows


def summary(rows: List[dict], micro: int = 1) -> dict:
    """MAPE, mean signed error and the interval's coverage at one micro-batch, per source."""
    out = {}
    for source in dict.fromkeys(r["run"]["source"] for r in rows):
        got = [r["predicted"].get(micro) for r in rows if r["run"]["source"] == source]
        got = [g for g in got if g and g.get("seconds") is not None]
        if not got:
            continue
        errors = [g["error"] for g in got]
        out[source] = {"runs": len(got), "mape": statistics.fmean(abs(e) for e in errors),
                       "signed": statistics.fmean(errors), "inside": sum(g["inside"] for g in got)}
    return out


def per_micro_batch_split(rows: List[dict], source: str = MTNLG, micro: int = 1) -> Optional[dict]:
    """Where one model ran at several data-parallel widths under one global batch (MT-NLG), each
    iteration is a x (micro-batches per replica) + c: a least-squares line through the published
    times and one through the predicted, so an error that grows with the GPU count is told as
    the per-micro-batch cost (a) or the per-iteration part (c: bubble, gradient sync, update)."""
    got = [(r["run"]["batch"] // (r["dp"] * micro), r["run"]["seconds"], r["predicted"].get(micro))
           for r in rows if r["run"]["source"] == source]
    got = [(m, s, g["seconds"]) for m, s, g in got if g and g.get("seconds") is not None]
    if len(got) < 3:
        return None
    ms = [m for m, _s, _p in got]
    pub = statistics.linear_regression(ms, [s for _m, s, _p in got])
    pred = statistics.linear_regression(ms, [p for _m, _s, p in got])
    return {"micro_batches": ms, "published": {"per_micro_batch": pub.slope, "per_iteration": pub.intercept},
            "predicted": {"per_micro_batch": pred.slope, "per_iteration": pred.intercept}}


def _print(rows: List[dict], cluster: str) -> None:
    print(f"published runs predicted on {cluster} (nothing fitted on them); error = predicted / published - 1")
    print(f"{'run':24} {'layout tp-pp-dp':>16} {'GPUs':>5} {'published':>10}  "
          + "  ".join(f"{'mb ' + str(m):>22}" for m in MICRO_BATCHES))
    for r in rows:
        run = r["run"]
        cells = []
        for m in MICRO_BATCHES:
            g = r["predicted"].get(m)
            if g is None:
                cells.append(f"{'-':>22}")
            elif g["seconds"] is None:
                cells.append(f"{'does not fit':>22}" if g["verdict"] == "fail" else f"{g['verdict'] or '?':>22}")
            else:
                cells.append(f"{g['seconds']:8.2f} s {g['error']:+6.1%} {'in ' if g['inside'] else 'OUT'}")
        published = f"{run['seconds']:8.2f} s" + (" " if run["stated"] else "*")
        print(f"{run['name']:24} {str(run['tp']) + '-' + str(run['pp']) + '-' + str(r['dp']):>16} "
              f"{run['gpus']:>5} {published:>10}  " + "  ".join(cells))
    print("* derived from the published teraFLOP/s per GPU with the paper's FLOP count; "
          "in / OUT: the published time inside the 80% interval")
    for source, s in summary(rows).items():
        print(f"{source}, micro-batch 1: {s['runs']} runs, MAPE {s['mape']:.1%}, mean signed {s['signed']:+.1%}, "
              f"{s['inside']} of {s['runs']} inside the 80% interval")
    for micro in MICRO_BATCHES:
        split = per_micro_batch_split(rows, micro=micro)
        if split:
            pub, pred = split["published"], split["predicted"]
            # a bare 1F1B pipeline's per-iteration part is its bubble, (pp - 1) micro-batches
            stages = next(r["run"]["pp"] for r in rows if r["run"]["source"] == MTNLG)
            print(f"MT-NLG as a x micro-batches + c (micro-batch {micro}; {split['micro_batches']} per replica): "
                  f"a {pred['per_micro_batch'] * 1e3:.0f} ms predicted against {pub['per_micro_batch'] * 1e3:.0f} ms "
                  f"published, c {pred['per_iteration']:.1f} s against {pub['per_iteration']:.1f} s "
                  f"(c / a: {pred['per_iteration'] / pred['per_micro_batch']:.1f} against "
                  f"{pub['per_iteration'] / pub['per_micro_batch']:.1f}; the bubble alone {stages - 1})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="dgx-a100", help="cluster profile or description (default dgx-a100)")
    ap.add_argument("--json", action="store_true", help="the rows and the summary as JSON")
    ap.add_argument("--write", type=Path, metavar="DIR", help="write each run's config at micro-batch 1 here")
    args = ap.parse_args(argv)
    if args.write:
        args.write.mkdir(parents=True, exist_ok=True)
        for run in RUNS:
            name = run.name.lower().replace(",", "").replace(" ", "-")
            (args.write / f"{name}.yml").write_text(f"# {run.name}: {run.source}; run with --gpus {run.gpus}\n"
                                                    + json.dumps(neox_config(run, 1), indent=1) + "\n")
    rows = predicted(cluster=args.cluster)
    if args.json:
        print(json.dumps({"cluster": args.cluster, "rows": rows, "summary": summary(rows),
                          "mtnlg_split": {m: per_micro_batch_split(rows, micro=m) for m in MICRO_BATCHES}},
                         indent=2))
    else:
        _print(rows, args.cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
