"""Measured end-to-end training iterations: the development set real predictions answer to.

vTrain (MICRO 2024, arXiv 2312.12391, MIT) published 1,440 iterations of Megatron-DeepSpeed
on 8-GPU A100 nodes (`../shared/data/vtrain-a100/single_node_runs.csv`). Each row becomes the
NeoX config that describes the same job, read through the same `build()` as a user's YAML,
so a row is predicted exactly as `neox-perf check` would predict it.

What the source does not state is assumed, as its README reads it: Megatron GPT (learned
positions, LayerNorm, GeLU, tied embeddings, fused softmax), fp16, GPT-2 vocabulary 50257,
activation checkpointing on, plain data parallel (no ZeRO). One default is Megatron-DeepSpeed's
own, read from its megatron/arguments.py: Q.K^T is scaled by the layer number
(`--no-query-key-layer-scaling` turns it off), which runs the softmax in fp32 -- NeoX's
apply_query_key_layer_scaling. Megatron-DeepSpeed builds the
pipeline engine only when pp > 1, which in NeoX terms is pipe_parallel_size 0 for pp = 1.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

VTRAIN_CSV = Path("data") / "vtrain-a100" / "single_node_runs.csv"
VTRAIN_MULTI_CSV = Path("data") / "vtrain-a100" / "multi_node_runs.csv"
VTRAIN_VOCAB = 50257  # GPT-2 BPE, padded by NeoX's (= Megatron's) rule
# Megatron-DeepSpeed's --attention-dropout and --hidden-dropout default, and what vTrain's own
# model of these runs uses (src/model/gpt_model.py: attention and output dropout 0.1).
MEGATRON_DROPOUT = 0.1

# Megatron-DeepSpeed's GPTModelPipe partitions with 'type:transformer' too, but its transposes
# around the layers are lambdas (named '<lambda>'), not NeoX's _pre/_post_transformer_block
# functions that the regex also matches: its stages hold equal shares of the transformer layers
# alone, which a regex on the layer class reproduces (N=12, pp=4: [3,3,3,3], not NeoX's
# [3,4,3,2]; pp=2 splits agree).
MEGATRON_PARTITION = "type:ParallelTransformerLayerPipe"
# Megatron-DeepSpeed's --pp-partition-method 'type:transformer|embedding' (written for BLOOM:
# bigscience-workshop/bigscience, train/tr11-176B-ml/chronicles-prequel.md, "Rebalancing
# layers"): the tied embedding at either end counts as one unit beside the transformer layers,
# so (layers + 2) / pp units per stage. The same regex on NeoX's layer list.
EMBEDDING_PARTITION = "type:ParallelTransformerLayerPipe|EmbeddingPipe"

# Megatron-DeepSpeed's pipeline stages pass the hidden states alone (the mask stays in its args),
# where NeoX's pass (hidden, mask): see operators.decompose
PIPE_SENDS_MASK = False

ASSUMPTIONS = ("Megatron GPT: learned positions, LayerNorm, GeLU, tied embeddings, fused softmax; "
               "query-key layer scaling (Megatron-DeepSpeed's default: softmax in fp32); "
               "attention and hidden dropout 0.1 (its default); fp16; stages split the "
               "transformer layers evenly (GPTModelPipe's partition); "
               "GPT-2 vocabulary 50257; activation checkpointing; no ZeRO; "
               "pp = 1 runs without the pipeline engine")


@dataclass(frozen=True)
class Run:
    """One measured iteration and the layout that produced it."""

    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    tp: int
    dp: int
    pp: int
    seconds: float  # measured iteration time
    model: str = ""  # the source's model label (multi-node runs: "3.6", "175", in billions)

    def __str__(self) -> str:
        name = f"{self.model}B " if self.model else ""
        return (f"{name}h{self.hidden} L{self.layers} tp{self.tp} dp{self.dp} pp{self.pp} "
                f"mb{self.micro_batch} gb{self.global_batch}: {self.seconds * 1e3:.0f} ms")

    @property
    def layout(self) -> Tuple[int, int, int]:
        return (self.tp, self.dp, self.pp)

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def neox_values(self) -> dict:
        """The NeoX config keys that describe this job."""
        return {
            "num_layers": self.layers, "hidden_size": self.hidden,
            "num_attention_heads": self.heads, "seq_length": self.seq_len,
            "max_position_embeddings": self.seq_len, "pos_emb": "learned", "norm": "layernorm",
            "activation": "gelu", "no_weight_tying": False,
            "scaled_upper_triang_masked_softmax_fusion": True, "bias_gelu_fusion": True,
            "apply_query_key_layer_scaling": True,
            "attention_dropout": MEGATRON_DROPOUT, "hidden_dropout": MEGATRON_DROPOUT,
            "pipe_partition_method": MEGATRON_PARTITION,
            "attention_config": [[["global"], self.layers]],
            "tokenizer_type": "GPT2BPETokenizer",
            "fp16": {"enabled": True}, "precision": "fp16",
            "checkpoint_activations": True,
            "pipe_parallel_size": self.pp if self.pp > 1 else 0,
            "model_parallel_size": self.tp,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "zero_optimization": {"stage": 0},
            "global_num_gpus": self.gpus,
            "train_iters": 1,
        }


def find_shared(start: Optional[Path] = None) -> Optional[Path]:
    """The project's `../shared/` beside the repo (or beside an ancestor), if present."""
    here = (start or Path(__file__)).resolve()
    for parent in [here, *here.parents]:
        candidate = parent.parent / "shared" if parent.name else None
        if candidate is not None and (candidate / "data").is_dir():
            return candidate
    return None


def load_vtrain(path: Optional[Path] = None) -> List[Run]:
    """Every row of vTrain's single-node runs; FileNotFoundError when the file is absent."""
    return _load(path, VTRAIN_CSV)


def load_vtrain_multi(path: Optional[Path] = None) -> List[Run]:
    """Every row of vTrain's multi-node runs (64 and 512 GPUs on 8-GPU nodes), each labelled
    with its model; FileNotFoundError when the file is absent."""
    return _load(path, VTRAIN_MULTI_CSV)


def _csv_path(path: Optional[Path], default: Path) -> Path:
    """`path`, or `default` under ../shared/; FileNotFoundError where there is no shared/."""
    if path is not None:
        return path
    shared = find_shared()
    if shared is None:
        raise FileNotFoundError(f"../shared/{default.as_posix()} not found")
    return shared / default


def _load(path: Optional[Path], default: Path) -> List[Run]:
    path = _csv_path(path, default)
    runs = []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            ints = {k: int(row[k]) for k in ("gpus", "global_batch", "micro_batch", "hidden", "heads",
                                             "layers", "seq_len", "tp", "dp", "pp")}
            run = Run(**ints, seconds=float(row["iteration_ms"]) / 1e3, model=row.get("params_b", ""))
            if run.tp * run.dp * run.pp != run.gpus or run.global_batch % (run.dp * run.micro_batch):
                raise ValueError(f"{path}: inconsistent row {row}")
            runs.append(run)
    return runs


# A run is reported apart from the fit when it is this much slower per micro-batch round (the
# 1F1B bubble's (m + p - 1) / m taken out) than the same job -- model, batch and layout -- at a
# smaller micro-batch. A larger micro-batch does the same work per GPU in fewer, larger kernels
# with fewer per-micro-batch costs: it can only take longer through something outside the model
# (memory pressure in the caching allocator, a disturbed run). The rule looks one way on purpose:
# a smaller micro-batch running much slower is ordinary (the host issuing small kernels cannot
# keep the GPU busy) and stays in the fit. It sets apart 1 of the 47 multi-node runs (the 3.6B
# model at tp 8, micro-batch 64: 1.98x its micro-batch 32) and none of the 1,440 single-node runs;
# no other run of either set is more than 1.013x the same job at a smaller micro-batch.
INCONSISTENT_RATIO = 1.3


def inconsistent(runs: Sequence[Run], ratio: float = INCONSISTENT_RATIO) -> List[bool]:
    """Per run: whether it is slower than the same job at a smaller micro-batch by ``ratio``."""
    rounds = [r.seconds * r.accumulation / (r.accumulation + r.pp - 1) for r in runs]
    groups: dict = {}
    for i, r in enumerate(runs):
        groups.setdefault((r.model, r.hidden, r.heads, r.layers, r.seq_len, r.global_batch, r.layout),
                          []).append(i)
    out = [False] * len(runs)
    for idx in groups.values():
        for i in idx:
            smaller = [rounds[j] for j in idx if runs[j].micro_batch < runs[i].micro_batch]
            out[i] = bool(smaller) and rounds[i] > ratio * min(smaller)
    return out


def build_config(run: Run, gpus_per_node: int):
    """(NeoxConfig, DerivedModel) of a run, through the same path as a user's YAML."""
    return _built(run, gpus_per_node, "vtrain row", str(run), VTRAIN_VOCAB)


def _built(run: Run, gpus_per_node: int, source: str, label: str, vocab: int):
    return build_values(run.neox_values(), run.gpus, gpus_per_node, source, label, vocab)


def build_values(values: dict, gpus: int, gpus_per_node: int, source: str, label: str, vocab: int):
    """(NeoxConfig, DerivedModel) of NeoX config values, through the same path as a user's YAML;
    ValueError naming `source` and `label` where NeoX would refuse them."""
    from neox_perf.config import WorldRequest, build
    from neox_perf.config.loader import RawConfig
    from neox_perf.derive import derive
    raw = RawConfig(values=values, sources={k: f"<{source}>" for k in values}, files=[f"<{source}>"])
    cfg, verdicts, _ = build(raw, WorldRequest(gpus=gpus, gpus_per_node=gpus_per_node))
    errors = [v for v in verdicts if v.level == "error"]
    if errors:
        raise ValueError(f"{source} {label}: {errors[0].message}")
    return cfg, derive(cfg, vocab)


def layouts(runs: Sequence[Run]) -> List[Tuple[int, int, int]]:
    return sorted({r.layout for r in runs})


# --- BigScience's BLOOM layout search on Jean Zay (../shared/data/bloom-jean-zay/) -------------
# 106 layouts of 176-206B candidate models timed (and 60 nvidia-smi peaks read) on IDRIS Jean
# Zay's A100-SXM4-80GB partition before BLOOM was trained, with Megatron-DeepSpeed (DeepSpeed's
# pipeline engine and ZeRO-1). A second cluster beside vTrain's, so that every fitted term can be
# judged on a cluster it was not fitted on (benchmarks/endtoend.py).
BLOOM_CSV = Path("data") / "bloom-jean-zay" / "layout_search_runs.csv"
BLOOM_VOCAB = 250680  # BLOOM's tokenizer; padded by Megatron's rule to the file's 250880
BLOOM_ASSUMPTIONS = ("BLOOM architecture in NeoX terms: ALiBi positions, LayerNorm, GeLU, tied "
                     "embeddings, fused softmax (the embedding LayerNorm, one norm per step, is "
                     "left out); fp16 unless the row says bf16; bf16 rows run DeepSpeed's "
                     "BF16_Optimizer (grad_accum_dtype fp32); activation checkpointing; dropout at "
                     "Megatron's default; stages split the transformer layers evenly "
                     "(GPTModelPipe's partition), and the embeddings with them where the row "
                     "says 'type:transformer|embed'; the stage hidden states alone cross a stage "
                     "boundary (no mask)")


@dataclass(frozen=True)
class BloomRun(Run):
    """One row of the BLOOM layout search: a measured iteration (seconds 0 where the layout ran
    out of memory) and, where nvidia-smi was read, the first node's peak."""

    ffn: int = 0
    vocab: int = BLOOM_VOCAB
    precision: str = "fp16"
    zero_stage: int = 1
    peak_mem_gb: Optional[float] = None  # nvidia-smi used memory as printed: GiB (nvidia-smi prints MiB; benchmarks/memory_bloom.py)
    oom: bool = False
    row_id: str = ""
    date: str = ""  # the day the row was timed: Jean Zay's speed varied from day to day
    section: str = ""  # the chronicle's section (one table compared under one condition)
    partition: str = MEGATRON_PARTITION  # the run's pipe partition method, in NeoX's layer names

    def __str__(self) -> str:
        return (f"{self.model}B h{self.hidden} L{self.layers} a{self.heads} tp{self.tp} dp{self.dp} "
                f"pp{self.pp} mb{self.micro_batch} gb{self.global_batch} {self.precision} "
                f"({self.row_id}): {self.seconds:.1f} s")

    def neox_values(self) -> dict:
        values = super().neox_values()
        bf16 = self.precision == "bf16"
        values.update({
            "pos_emb": "alibi", "intermediate_size": self.ffn,
            "fp16": {"enabled": not bf16}, "bf16": {"enabled": bf16},
            "precision": "bfloat16" if bf16 else "fp16",
            "zero_optimization": {"stage": self.zero_stage},
            # BigScience's bf16 runs used DeepSpeed's BF16_Optimizer (fp32 gradient
            # accumulation, written for BLOOM's bf16 training); DeepSpeed 0.19.8 builds it for
            # bf16 + ZeRO-1 when grad_accum_dtype is fp32 (engine.py _do_optimizer_sanity_check)
            **({"data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}),
            "apply_query_key_layer_scaling": False,
            "tokenizer_type": "HFTokenizer",
            "pipe_partition_method": self.partition,
        })
        return values


def load_bloom(path: Optional[Path] = None, *, timed_only: bool = False) -> List[BloomRun]:
    """Every row of the BLOOM layout search (timed_only: those with a measured iteration);
    FileNotFoundError when the file is absent."""
    path = _csv_path(path, BLOOM_CSV)
    runs = []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            ints = {k: int(row[k]) for k in ("gpus", "layers", "hidden", "heads", "ffn", "seq",
                                             "tp", "pp", "dp", "mbs", "gbs")}
            oom = row["oom"].strip() == "True"
            seconds = float(row["iter_s"]) if row["iter_s"].strip() else 0.0
            notes = row.get("notes", "")
            run = BloomRun(
                gpus=ints["gpus"], global_batch=ints["gbs"], micro_batch=ints["mbs"],
                hidden=ints["hidden"], heads=ints["heads"], layers=ints["layers"],
                seq_len=ints["seq"], tp=ints["tp"], dp=ints["dp"], pp=ints["pp"], seconds=seconds,
                model=f"{float(row['params_b']):.0f}", ffn=ints["ffn"],
                vocab=int(row["vocab"]),
                precision="bf16" if row["precision"].strip().startswith("bf16") else "fp16",
                zero_stage=1 if row["zero_stage"].strip() != "0" else 0,
                peak_mem_gb=float(row["peak_mem_gb"]) if row["peak_mem_gb"].strip() else None,
                oom=oom, row_id=row["id"], date=_field(notes, "date "),
                section=_section(notes), partition=_partition(notes))
            if run.tp * run.dp * run.pp != run.gpus or run.global_batch % (run.dp * run.micro_batch):
                raise ValueError(f"{path}: inconsistent row {row['id']}")
            if timed_only and (oom or seconds <= 0):
                continue
            runs.append(run)
    return runs


def _field(notes: str, prefix: str) -> str:
    for part in notes.replace(";", ",").split(","):
        part = part.strip()
        if part.startswith(prefix):
            return part[len(prefix):].strip()
    return ""


def _partition(notes: str) -> str:
    """The pipe partition a row's notes state ("partition_method 'type:transformer|embed'",
    "partition 'type:transformer|embedding'": the chronicle's tables from 2022-02-27 on), else
    GPTModelPipe's default."""
    return EMBEDDING_PARTITION if "'type:transformer|embed" in notes else MEGATRON_PARTITION


def _section(notes: str) -> str:
    start = notes.find("section '")
    if start < 0:
        return ""
    end = notes.find("'", start + 9)
    return notes[start + 9:end] if end > 0 else ""


def build_bloom_config(run: BloomRun, gpus_per_node: int):
    """(NeoxConfig, DerivedModel) of a BLOOM row, through the same path as a user's YAML."""
    return _built(run, gpus_per_node, "bloom row", run.row_id, run.vocab)


def bloom_cases(runs: Sequence[BloomRun], profile):
    """The rows as step_fit cases on a Jean Zay profile (a cluster description), keyed by model
    and layout: what benchmarks/endtoend.py fits and predicts, benchmarks/bloom_rows.py and the
    tests predict."""
    from .step_fit import prepare
    return prepare(runs, lambda r: build_bloom_config(r, profile.facts.gpus_per_node),
                   key=lambda r: ("bloom", r.model) + r.layout, profile=profile,
                   pipe_sends_mask=PIPE_SENDS_MASK)
