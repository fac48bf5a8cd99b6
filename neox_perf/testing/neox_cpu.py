"""GPT-NeoX's own training program on this CPU machine: data, config, launch, log.

    from neox_perf.testing import neox_cpu
    run = neox_cpu.run_layout(neox_cpu.LAYOUTS["pp2"], work_dir, hook_dir=None)
    run.losses, run.logged_params, run.iteration_ms

Every layout is a NeoX YAML launched with NeoX's unmodified `deepy.py` (the script it runs
is neox_train.py: CPU shims, then NeoX's `train.main()`), optionally under
`neox-perf run --run-dir D`. Where NeoX comes from:
- NEOX_PERF_NEOX_SRC: a GPT-NeoX checkout (tests skip without one);
- NEOX_PERF_NEOX_PYTHON: a Python that imports it (numpy < 2, setuptools < 81,
  transformers 4.38 ...; default: this one).
This module never imports torch: it only writes files and starts processes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import yaml

from neox_perf.calibration.launch import CACHING_MALLOC_ENV, free_port, remove_shm_buffers
from neox_perf.config.loader import load_files
from neox_perf.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
# the script deepy.py launches in place of train.py: it runs inside NeoX's ranks and imports
# torch, so it lives with the other in-rank code under hooks/
TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__import__(
    "neox_perf.hooks", fromlist=["__file__"]).__file__)), "neox_train.py")
SRC_ENV, PYTHON_ENV = "NEOX_PERF_NEOX_SRC", "NEOX_PERF_NEOX_PYTHON"


class NeoxUnavailable(Exception):
    """No usable NeoX checkout / Python here; the message says what to set."""


def neox_src(path: Optional[str] = None) -> str:
    src = path or os.environ.get(SRC_ENV, "")
    if not src:
        raise NeoxUnavailable(f"no GPT-NeoX checkout: set {SRC_ENV} (or pass --neox)")
    if not os.path.isfile(os.path.join(src, "deepy.py")) or \
            not os.path.isfile(os.path.join(src, "megatron", "training.py")):
        raise NeoxUnavailable(f"{src}: not a GPT-NeoX checkout (no deepy.py / megatron/training.py)")
    return os.path.abspath(src)


def neox_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


@dataclass(frozen=True)
class Layout:
    """One NeoX layout on `gpus` CPU processes. Sizes are chosen so the operators, not
    Python, dominate an iteration (what a real GPU run looks like to the hook)."""

    name: str
    gpus: int = 2
    pp: int = 1
    mp: int = 1
    zero_stage: int = 0
    checkpoint: bool = False
    micro: int = 2
    gas: int = 2
    pos_emb: str = "rotary"
    tied: bool = False
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    iters: int = 12
    extra: Dict[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"pp={self.pp}", f"mp={self.mp}", f"dp={self.dp}", f"micro={self.micro}",
                 f"gas={self.gas}", self.pos_emb, "tied" if self.tied else "untied"]
        if self.zero_stage:
            parts.append(f"ZeRO-{self.zero_stage}")
        if self.checkpoint:
            parts.append("act-ckpt")
        return " ".join(parts)

    @property
    def dp(self) -> int:
        return self.gpus // max(self.pp, 1) // max(self.mp, 1)


# Each required feature is in at least one layout; two processes each (the machine has 2 cores).
LAYOUTS: Dict[str, Layout] = {lay.name: lay for lay in (
    Layout("pp0", pp=0, pos_emb="rotary", tied=False),
    Layout("pp1", pp=1, pos_emb="learned", tied=True),
    Layout("pp2", pp=2, gas=4, pos_emb="rotary", tied=True),
    Layout("mp2", pp=1, mp=2, pos_emb="rotary", tied=False),
    Layout("zero1", pp=0, zero_stage=1, pos_emb="learned", tied=False),
    Layout("ckpt", pp=1, checkpoint=True, gas=3, pos_emb="rotary", tied=False),
)}


def config_values(layout: Layout, data_prefix: str) -> dict:
    """The NeoX YAML of a layout, as NeoX keys."""
    values = {
        "pipe_parallel_size": layout.pp, "model_parallel_size": layout.mp,
        # no hostfile and no GPU: NeoX takes the world size from these (obstacle 7)
        "global_num_gpus": layout.gpus, "num_gpus": layout.gpus,
        "distributed_backend": "gloo",
        "num_layers": layout.layers, "hidden_size": layout.hidden,
        "num_attention_heads": layout.heads, "seq_length": layout.seq,
        "max_position_embeddings": layout.seq, "pos_emb": layout.pos_emb,
        "no_weight_tying": not layout.tied, "norm": "layernorm",
        "train_micro_batch_size_per_gpu": layout.micro,
        "gradient_accumulation_steps": layout.gas,
        "optimizer": {"type": "Adam", "params": {"lr": 0.0006, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "precision": "fp32",
        "zero_optimization": {"stage": layout.zero_stage},
        "checkpoint_activations": layout.checkpoint, "checkpoint_num_layers": 1,
        "train_iters": layout.iters, "lr_decay_iters": layout.iters,
        "log_interval": 1, "steps_per_print": 100000,
        # no evaluation: NeoX's pipeline eval path fails on upstream DeepSpeed (see the note)
        "eval_interval": 100000, "eval_iters": 0,
        "data_path": data_prefix, "data_impl": "mmap", "split": "1000,0,0",
        "tokenizer_type": "CharLevelTokenizer", "num_workers": 0,
        "no_save_rng": True, "no_load_rng": True, "seed": 1234,
        # dropout draws random numbers whose order depends on nothing we time; keep it,
        # NeoX's defaults are 0 anyway
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        # deepy's launcher rendezvous port (default 29500): two runs at once must not share it
        "master_port": free_port(),
    }
    values.update(layout.extra)
    return values


def build_dataset(work_dir: str, src: Optional[str] = None) -> str:
    """The mmap dataset prefix (built once per work dir)."""
    src = neox_src(src)
    prefix = os.path.join(work_dir, "data", "enwik8")
    if os.path.exists(prefix + "_text_document.idx"):
        return prefix + "_text_document"
    proc = subprocess.run([neox_python(), "-m", "neox_perf.testing.neox_data", "--neox-src", src,
                           "--out", prefix], capture_output=True, text=True, env=_env(src))
    if proc.returncode != 0:
        raise NeoxUnavailable("building the dataset with NeoX's indexed_dataset failed: "
                              + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return prefix + "_text_document"


def write_config(layout: Layout, out_dir: str, data_prefix: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{layout.name}.yml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"# GPT-NeoX layout {layout.name}: {layout.describe()} (written by neox_perf.testing)\n")
        yaml.safe_dump(config_values(layout, data_prefix), fh, sort_keys=False)
    return path


def _env(src: str, extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    py_bin = os.path.dirname(neox_python())
    # NeoX builds its dataset helpers with `make` (python3 -m pybind11, python3-config).
    env["PATH"] = py_bin + os.pathsep + env.get("PATH", "")
    repo = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    env.update({SRC_ENV: src, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    # NeoX's ranks recycle large tensors as calibrate's and validate's CPU processes do (and a
    # GPU's caching allocator): without it each tensor over glibc's mmap threshold pays fresh
    # page faults, which no prediction prices (the harness's six layouts: 4.5% against 6.3%
    # mean error against the median iteration, docs/neox-harness.md sittings 12-13)
    env.update(CACHING_MALLOC_ENV)
    env.update(extra or {})
    return env


@dataclass
class NeoxRun:
    layout: Optional[Layout]
    config: str
    log: str
    returncode: int
    seconds: float
    run_dir: Optional[str] = None
    losses: Dict[int, Dict[int, str]] = field(default_factory=dict)  # iteration -> rank -> hex
    step_seconds: Dict[int, List[float]] = field(default_factory=dict)  # rank -> per iteration
    logged_params: Optional[int] = None  # NeoX's "> total params"
    rank_params: Dict[int, int] = field(default_factory=dict)  # model-parallel rank -> params
    stage_params: Dict[int, int] = field(default_factory=dict)  # DeepSpeed STAGE_PARAMS
    iteration_ms: List[float] = field(default_factory=list)  # NeoX's "elapsed time per iteration"
    log_losses: List[float] = field(default_factory=list)  # NeoX's printed lm_loss
    partition: Optional[List[int]] = None  # DeepSpeed's stage boundaries, from its log
    memory: List[dict] = field(default_factory=list)  # per rank: hooks.memory's measurement
    megatron_config: Optional[str] = None  # what deepy.py handed every rank

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.losses)

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.log.splitlines()[-n:])

    def loss_series(self) -> List[str]:
        """Rank 0's exact losses, iteration order (what "bit-identical" compares)."""
        return [self.losses[i].get(min(self.losses[i])) for i in sorted(self.losses)]


_TOTAL = re.compile(r"> total params: ([\d,]+)")
_RANK = re.compile(r"number of parameters on model parallel rank (\d+): (\d+)")
_STAGE = re.compile(r"RANK=(\d+) STAGE=(\d+) LAYERS=\d+ \[(\d+), (\d+)\) STAGE_PARAMS=(\d+)")
_LAYERS = re.compile(r"^stage=(\d+) layers=(\d+)\s*$", re.M)
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \| elapsed time per iteration \(ms\): ([\d.]+)")
_MEGATRON = re.compile(r"--megatron_config['\",]*\s*['\"]?([A-Za-z0-9_=-]{20,})")
_LOSS = re.compile(r"lm_loss: ([-\d.E+]+)")


def parse_log(run: NeoxRun) -> None:
    text = run.log
    m = _TOTAL.search(text)
    run.logged_params = int(m.group(1).replace(",", "")) if m else None
    run.rank_params = {int(a): int(b) for a, b in _RANK.findall(text)}
    bounds = {}
    for rank, stage, lo, hi, params in _STAGE.findall(text):
        run.stage_params[int(stage)] = int(params)
        bounds[int(stage)] = (int(lo), int(hi))
    if bounds:
        run.partition = [bounds[s][0] for s in sorted(bounds)] + [bounds[max(bounds)][1]]
    else:  # PipelineModule's own print on rank 0: "stage=i layers=k", then the layer names
        counts = {int(st): int(n) for st, n in _LAYERS.findall(text)}
        if counts and sorted(counts) == list(range(len(counts))):
            run.partition = [0]
            for st in sorted(counts):
                run.partition.append(run.partition[-1] + counts[st])
    m = _MEGATRON.search(text)
    run.megatron_config = m.group(1) if m else None
    for line in text.splitlines():
        m = _ITER.search(line)
        if m:
            run.iteration_ms.append(float(m.group(2)))
            loss = _LOSS.search(line)
            if loss:
                run.log_losses.append(float(loss.group(1)))


def _read_losses(path: str, run: NeoxRun) -> None:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            run.losses.setdefault(int(rec["iteration"]), {})[int(rec["rank"])] = rec["loss"]
            run.step_seconds.setdefault(int(rec["rank"]), []).append(float(rec["seconds"]))


def launch(config: str, out_dir: str, *, src: Optional[str] = None, hook_dir: Optional[str] = None,
           cluster: Optional[str] = None, windows: Optional[str] = None, layout: Optional[Layout] = None,
           timeout: float = 1800, env: Optional[dict] = None) -> NeoxRun:
    """NeoX's deepy.py on `config` (one or more YAML, os.pathsep-free list allowed), with
    the hook on when `hook_dir` is given. The log goes to out_dir/<name>.log."""
    src = neox_src(src)
    configs = [config] if isinstance(config, str) else list(config)
    name = os.path.splitext(os.path.basename(configs[-1]))[0] + ("-hook" if hook_dir else "")
    os.makedirs(out_dir, exist_ok=True)
    loss_file = os.path.join(out_dir, f"{name}.losses.jsonl")
    memory_file = os.path.join(out_dir, f"{name}.memory.jsonl")
    for stale in (loss_file, memory_file):
        if os.path.exists(stale):
            os.remove(stale)
    cmd = [neox_python(), os.path.join(src, "deepy.py"), TRAIN_SCRIPT] + [os.path.abspath(c) for c in configs]
    if hook_dir:
        pre = [neox_python(), "-m", "neox_perf", "run", "--run-dir", hook_dir]
        if cluster:
            pre += ["--cluster", cluster]
        if windows:
            pre += ["--windows", windows]
        cmd = pre + ["--"] + cmd
    log_path = os.path.join(out_dir, f"{name}.log")
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(cmd, cwd=src, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  env=_env(src, {"NEOX_PERF_NEOX_LOSS_FILE": loss_file,
                                                 "NEOX_PERF_NEOX_MEMORY_FILE": memory_file,
                                                 **(env or {})}))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = -9
    _release_shared_memory(configs)
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    run = NeoxRun(layout=layout, config=configs[-1], log=text, returncode=rc,
                  seconds=time.monotonic() - t0, run_dir=hook_dir)
    parse_log(run)
    _read_losses(loss_file, run)
    run.memory = _read_jsonl(memory_file)
    return run


def _release_shared_memory(configs: List[str]) -> None:
    """A launch the hook did not run in (or that died) leaves DeepSpeed's CPU comm buffers,
    ~66 MB per rank, named after deepy's rendezvous port: take them back."""
    try:
        port = load_files(configs).values.get("master_port")
    except ConfigError:
        return  # deepy refused the files too: it never launched
    if port is not None:
        remove_shm_buffers(port)


def _read_jsonl(path: str) -> List[dict]:
    out = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return sorted(out, key=lambda r: r.get("rank", 0))


def run_layout(layout: Layout, work_dir: str, *, src: Optional[str] = None,
               hook_dir: Optional[str] = None, cluster: Optional[str] = None,
               windows: Optional[str] = None, **overrides) -> NeoxRun:
    if overrides:
        layout = dataclasses.replace(layout, **overrides)
    data = build_dataset(work_dir, src)
    cfg = write_config(layout, os.path.join(work_dir, "configs"), data)
    if hook_dir and os.path.isdir(hook_dir):
        shutil.rmtree(hook_dir)
    return launch(cfg, os.path.join(work_dir, "logs"), src=src, hook_dir=hook_dir, cluster=cluster,
                  windows=windows, layout=layout)
