"""Engine calibration: what the operator benchmarks cannot see.

The operator samples time each kernel alone, hot in cache, with F.cross_entropy and a flat
Adam. A real step also runs the layer's glue (bias adds, copies, residual-gradient sums),
touches operands that are no longer in cache, computes NeoX's multi-pass vocab-parallel
loss, and DeepSpeed's own work: gradient clipping + the optimizer over every parameter
tensor, flattening gradients for the all-reduce, accumulating gradients between micro-
batches. This step runs the reference workload's own model under a one-process DeepSpeed
engine at the shapes below (never the validation configs) and records what each part took;
predictors/fitting/engine_fit.py turns the differences from the operator predictions into the profile's
"engine" terms. The measuring runs in its own processes: python -m neox_perf.calibration.engine.

A second pass runs the same shapes under DeepSpeed's ZeRO stage-1 optimizer, the processes
forming one data-parallel group (see _measure_zero): that optimizer does different work from
the plain one -- it copies every gradient into a reduce bucket, all-reduces it whole, keeps
its own partition, steps one flat fp32 partition and all-gathers the updated parameters --
and its collectives move the whole model at once, far beyond the collective benchmark's sizes.

A third pass runs the same shapes tensor parallel: the processes one model-parallel group of
TP_SIZE (see _engine_for), the layers' column- and row-parallel GEMMs each rank's share and
their all-reduces inside the layer, as NeoX's mpu places them. A tensor-parallel layer in
training is not its operators plus its all-reduces priced apart: at every all-reduce the
peers wait for each other, and each waits for the other's gloo threads on shared cores
(predictors/fitting/engine_fit.py fits that as the tp_ terms).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .launch import (CalibrationFailed, free_port, port_taken, progress_event, progress_line,
                     rank_env, remove_shm_buffers)
from .phase_clock import PhaseClock

# (hidden, seq, micro_batch, norm, attention, vocab): the quick plan's grid points
ENGINE_SHAPES = (
    (128, 256, 2, "layernorm", "global", 8192),
    (256, 128, 1, "rmsnorm", "global", 8192),
    (256, 512, 2, "layernorm", "global", 8192),
    (256, 256, 4, "rmsnorm", "flash", 32768),
    (512, 256, 1, "rmsnorm", "flash", 32768),
    (512, 128, 2, "layernorm", "global", 32768),
    (512, 512, 2, "layernorm", "flash", 8192),
    (1024, 128, 1, "layernorm", "global", 8192),
    (1024, 256, 2, "rmsnorm", "flash", 8192),
    (1024, 512, 2, "rmsnorm", "global", 8192),
)
ENGINE_DEPTHS = (2,)  # layers per calibration model
ENGINE_WARMUP, ENGINE_REPEATS = 2, 3  # per sweep, after each sweep's fresh engine
# Each shape is measured in ENGINE_SWEEPS sweeps over the shapes, the second in reverse order,
# and its repeats pooled: a shape's repeats taken back to back share the machine's state of those
# seconds. On this project's 2-core VM two calibrations 30 minutes apart measured single shapes
# 20-26% apart with every one of that shape's five repeats on the same side (e.g. d512 l512 b2
# layer forward 0.265-0.289 s in one, 0.203-0.261 s in the other), where the shapes' repeats
# spread 5-15% within one calibration: the spread between calibrations came in blocks, which no
# statistic over one block removes. Spread over the pass -- the reverse order puts every
# shape's two sweeps on both sides of its middle -- each shape sees the same mix of the pass's
# machine states, so the shapes' ratios (which the layer residuals interpolate between) no
# longer carry one block's luck.
ENGINE_SWEEPS = 2


def engine_path(store: Path) -> Path:
    return store.with_suffix(".engine.json")


def engine_keys(shape, layers: int, zero: int = 0, mp: int = 1) -> Dict[str, object]:
    hidden, seq, micro, norm, attention, _vocab = shape
    keys = {"pipe_parallel_size": 0, "model_parallel_size": mp, "num_layers": layers,
            "hidden_size": hidden, "num_attention_heads": hidden // 64, "seq_length": seq,
            "max_position_embeddings": seq, "pos_emb": "rotary", "norm": norm,
            "no_weight_tying": True, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.0001}}}
    if attention == "flash":
        keys["attention_config"] = [[["flash"], layers]]
    if zero:
        # DeepSpeed's own defaults for the rest, as a NeoX config giving only the stage gets
        keys["zero_optimization"] = {"stage": zero}
    return keys


def tp_splits(shape) -> bool:
    """Whether a shape's attention heads (hidden / 64) split over a TP_SIZE group."""
    heads = shape[0] // 64
    return heads >= TP_SIZE and heads % TP_SIZE == 0


def engine_label(shape, layers: int) -> str:
    hidden, seq, micro, norm, attention, vocab = shape
    return f"d{hidden} l{seq} b{micro} {norm} {attention} V{vocab} x{layers}"


ZERO_STAGE = 1  # the second pass; stage 2 runs the same optimizer class
TP_SIZE = 2  # the third pass: tensor-parallel groups of two (the smallest, and this machine's)
# A tensor-parallel phase's repeats spread far wider than one rank's own (1.1-2x between the
# fastest and slowest of five on this 2-core machine: the ranks wait for each other and for
# gloo's threads): the pass takes more of them for its medians.
TP_REPEATS = 6  # per sweep (ENGINE_SWEEPS of them)


def run_engine(path: Path, device: str, progress=None, shapes=ENGINE_SHAPES,
               nproc: int = 1) -> Dict[str, object]:
    """Measure every engine shape not yet in ``path`` (JSON, rewritten after each shape).

    ``nproc`` processes run the same models in lockstep (a barrier before every timed phase),
    each with its own one-process engine, and the first one records: in training every
    device steps at once, and devices that share a memory system (CPU "GPUs") slow each
    other down in the memory-bound phases -- measured here, not assumed. Then the ZeRO pass:
    the same shapes, the ``nproc`` processes one data-parallel group of a ZeRO-1 engine; then,
    for an even ``nproc``, the tensor-parallel pass: the shapes whose heads split in TP_SIZE
    groups, at mp TP_SIZE."""
    todo = [(s, n) for s in shapes for n in ENGINE_DEPTHS]
    data = json.loads(path.read_text()) if path.is_file() else {}
    # the tensor-parallel pass: an even number of processes, and the shapes whose heads split
    tp_shapes = tuple(s for s in shapes if tp_splits(s)) if nproc % TP_SIZE == 0 else ()
    tp_todo = [(s, n) for s in tp_shapes for n in ENGINE_DEPTHS]
    have, have_zero, have_tp = data.get("shapes", {}), data.get("zero", {}), data.get("tp", {})

    def stored(rows, todo_):  # (shapes complete, sweeps done) of one pass
        swept = [sweeps_done(rows.get(engine_label(s, n))) for s, n in todo_]
        return sum(k >= ENGINE_SWEEPS for k in swept), sum(swept)
    (before, swept), (before_zero, swept_zero), (before_tp, swept_tp) = (
        stored(have, todo), stored(have_zero, todo), stored(have_tp, tp_todo))
    # progress counts shape-sweeps: each sweep of each shape is one event
    done = [swept + swept_zero + swept_tp]
    total = ENGINE_SWEEPS * (2 * len(todo) + len(tp_todo))
    if progress is not None:
        progress(done[0], total, "starting")

    def measured(line: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total, line)

    extra = _shapes_arg(shapes)
    plain = _run_peers(path, device, nproc, extra, measured, zero=0)
    zero = _run_peers(path, device, nproc, extra, measured, zero=ZERO_STAGE)
    out = {"shapes": len(todo), "already_stored": before, "measured": plain, "processes": nproc,
           "zero": {"stage": ZERO_STAGE, "already_stored": before_zero, "measured": zero}}
    if tp_todo:
        tp = _run_peers(path, device, nproc, _shapes_arg(tp_shapes), measured, zero=0, mp=TP_SIZE)
        out["tp"] = {"size": TP_SIZE, "shapes": len(tp_todo), "already_stored": before_tp,
                     "measured": tp}
    return out


# A pass whose second sweep ran slower (or faster) than its first across its shapes: the machine's
# speed moved for as long as a sweep, which pooling the two halves cannot average away and the
# step watch (other processes' CPU, steal) does not see. Flagged where the shift, the median
# over shapes of log(sweep 2 / sweep 1) of a shape's whole phases, is both beyond SHIFT_LIMIT
# -- pooled, it moves the row's median by up to half of it, past the reproducibility bar of 3%
# -- and beyond SHIFT_Z standard errors of that median (the shapes' own scatter, robust: MAD).
# On 2026-12-02 one calibration's tensor-parallel pass shifted +11.4% (z 2.7) and put its mp 2
# layouts 12-22% over their launches; the five other passes of that day's two calibrations
# shifted -4.0% to +1.5%, and a ZeRO pass -12.4% at z 1.2 (its collectives' scatter).
SHIFT_LIMIT, SHIFT_Z = 0.06, 2.5
_SWEEP_PHASES = {"shapes": ("forward", "backward"), "tp": ("forward", "backward"),
                 "zero": ("reduce", "step")}
_PASS_NAMES = {"shapes": "plain", "tp": "tensor-parallel", "zero": "ZeRO"}


def sweep_shifts(data: Dict[str, object]) -> Dict[str, Dict[str, float]]:
    """Per pass of an engine file: the shift between its two sweeps (log of sweep 2 over sweep 1,
    the median over its shapes of each shape's median repeat), its standard error, and how many
    shapes. Passes with fewer than 3 shapes measured in both sweeps are left out."""
    out = {}
    for section in _SWEEP_PHASES:
        logs = []
        for row in (data.get(section) or {}).values():
            pair = sweep_medians(row, section)
            if pair is not None and pair[0] > 0 and pair[1] > 0:
                logs.append(math.log(pair[1] / pair[0]))
        if len(logs) < 3:
            continue
        mid = statistics.median(logs)
        mad = statistics.median(abs(x - mid) for x in logs)
        # the median's standard error from a robust sigma (1.4826 MAD) at its 1.2533 efficiency
        se = 1.4826 * mad * 1.2533 / math.sqrt(len(logs))
        out[section] = {"shift": mid, "se": se, "shapes": len(logs)}
    return out


def sweep_medians(row: Dict[str, object], section: str) -> Optional[Tuple[float, float]]:
    """A stored shape's (first sweep, second sweep) median repeat of its pass's phases summed
    (_SWEEP_PHASES); None for a row measured in one sweep."""
    repeats, sweeps = row.get("repeats") or (), int(row.get("sweeps", 1))
    if sweeps < 2 or len(repeats) < 2:
        return None
    n = len(repeats) // sweeps
    totals = [sum(float(r[k]) for k in _SWEEP_PHASES[section]) for r in repeats]
    return statistics.median(totals[:n]), statistics.median(totals[n:2 * n])


def sweep_flagged(shift: Dict[str, float]) -> bool:
    """Whether one pass's shift (an item of sweep_shifts) is beyond both SHIFT_LIMIT and SHIFT_Z
    standard errors: the rule sweep_findings flags by."""
    return abs(shift["shift"]) > SHIFT_LIMIT and abs(shift["shift"]) > SHIFT_Z * shift["se"]


def sweep_findings(path: Path) -> List[str]:
    """One line per pass of the engine file at ``path`` whose sweeps disagree (SHIFT_LIMIT and
    SHIFT_Z): what the step watch's record of the engine step carries as its reason."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    lines = []
    for section, s in sweep_shifts(data).items():
        shift = s["shift"]
        if sweep_flagged(s):
            lines.append(f"its {_PASS_NAMES[section]} pass ran {math.exp(shift) - 1:+.0%} in its second "
                         f"sweep against its first across {s['shapes']} shapes (the machine's speed "
                         f"moved for a whole sweep; limit {SHIFT_LIMIT:.0%})")
    return lines


def sweeps_done(row) -> int:
    """How many of ENGINE_SWEEPS sweeps a stored shape's row holds (none stored: 0; a row
    written before sweeps, with all its repeats in one block: complete, as it was)."""
    if row is None:
        return 0
    return int(row.get("sweeps", ENGINE_SWEEPS))


def sweep_plan(todo, done: Dict[str, int]) -> List[tuple]:
    """The (sweep, shape, layers) a pass still measures, in order: ENGINE_SWEEPS sweeps over
    ``todo``, every other one in reverse, each skipping what ``done`` (label: sweeps stored)
    already holds. Every peer plans from the same file, read at the start (only peer 0 writes
    it), so all of them measure the same shapes in the same order."""
    plan = []
    for sweep in range(ENGINE_SWEEPS):
        for shape in (tuple(todo) if sweep % 2 == 0 else tuple(reversed(tuple(todo)))):
            for layers in ENGINE_DEPTHS:
                if done.get(engine_label(shape, layers), 0) <= sweep:
                    plan.append((sweep, shape, layers))
    return plan


def pooled(old: Dict[str, object], new: Dict[str, object], zero: bool) -> Dict[str, object]:
    """A shape's row after one more sweep: the sweeps' timed repeats together, and the row's
    statistics over all of them (the fastest of the rank's own work; for the ZeRO pass's
    collectives the median, as zero_statistics)."""
    repeats = list(old["repeats"]) + list(new["repeats"])
    stats = zero_statistics(repeats) if zero else fastest(repeats)
    out = {**new, **stats, "repeats": repeats, "sweeps": sweeps_done(old) + 1}
    out.pop("speeds", None)
    # a reading per sweep, or none: a sweep stored without one leaves the row as timed
    speeds = list(old.get("speeds") or ()) + list(new.get("speeds") or ())
    if len(speeds) == out["sweeps"]:
        out["speeds"] = speeds
    return out


def _shapes_arg(shapes) -> List[str]:
    """The worker's --shapes for a pass over ``shapes`` (none: the default ENGINE_SHAPES)."""
    return [] if tuple(shapes) == ENGINE_SHAPES else ["--shapes", json.dumps([list(s) for s in shapes])]


class _PortTaken(Exception):
    """Another process bound a port between free_port() and the rendezvous."""

    def __init__(self, stored: int):
        super().__init__(stored)
        self.stored = stored


def _run_peers(path: Path, device: str, nproc: int, extra: List[str], measured, zero: int,
               mp: int = 1) -> int:
    """One pass over the shapes in ``nproc`` processes, calling ``measured(label)`` per stored
    shape; returns how many were stored. Plain pass: each process a world of one (its engine
    must not reduce across them). ZeRO pass: one world of ``nproc``, the data-parallel group
    the optimizer partitions over. Tensor-parallel pass (``mp`` > 1): one world of ``nproc``,
    groups of ``mp``. A port taken before the rendezvous bound it is retried on new ports (and
    only that): the pass resumes past what it stored."""
    stored = 0
    for attempt in range(3):
        try:
            return stored + _run_peers_once(path, device, nproc, extra, measured, zero,
                                            last=attempt == 2, mp=mp)
        except _PortTaken as taken:
            stored += taken.stored
    return stored  # unreachable: the last attempt raises CalibrationFailed instead


def _run_peers_once(path: Path, device: str, nproc: int, extra: List[str], measured, zero: int,
                    last: bool, mp: int = 1) -> int:
    cmd = [sys.executable, "-m", __name__, str(path), "--device", device,
           "--peers", str(nproc), "--barrier-port", str(free_port()), *extra]
    if zero:
        cmd += ["--zero", str(zero)]
    if mp > 1:
        cmd += ["--mp", str(mp)]
    one_world = bool(zero) or mp > 1
    tag = "zero." if zero else "tp." if mp > 1 else ""
    logs = [path.with_suffix(f".{tag}{peer}.log") for peer in range(nproc)]
    master = str(free_port())
    procs, ports, count = [], [], 0
    try:
        for peer in range(nproc):
            env = rank_env(device)
            ports.append(master if one_world else str(free_port()))
            if one_world:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=master, RANK=str(peer),
                           WORLD_SIZE=str(nproc), LOCAL_RANK=str(peer), LOCAL_WORLD_SIZE=str(nproc))
            else:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=ports[-1], RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK=str(peer), LOCAL_WORLD_SIZE="1")
            out = subprocess.PIPE if peer == 0 else open(logs[peer], "w")
            procs.append(subprocess.Popen(cmd + ["--peer", str(peer)], env=env, stdout=out,
                                          stderr=subprocess.STDOUT, text=True))
        # A peer that dies (e.g. the OOM killer) leaves the others blocked in a collective or
        # a barrier for good: stop them all as soon as one fails.
        threading.Thread(target=_stop_all_on_failure, args=(procs,), daemon=True).start()
        with open(logs[0], "w") as fh:
            for line in procs[0].stdout:
                fh.write(line)
                event = progress_event(line)
                if event is not None and "measured" in event:
                    count += bool(event.get("complete", True))  # shapes with every sweep
                    measured(str(event["measured"]))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:  # a failed peer would leave the others waiting at a barrier
            if p.poll() is None:
                p.kill()
                p.wait()
        for port in set(ports):
            remove_shm_buffers(port)
    if any(codes):
        peer = next(i for i, c in enumerate(codes) if c)
        raw = logs[peer].read_text(errors="replace")
        if not last and port_taken(raw):
            raise _PortTaken(count)
        text = raw.strip().splitlines()
        what = f"ZeRO-{zero} engine" if zero else f"mp {mp} engine" if mp > 1 else "engine"
        raise CalibrationFailed(f"{what} calibration failed (process {peer}, exit {codes[peer]}): "
                                f"{(text or ['no output'])[-1][-300:]} (log: {logs[peer]})")
    return count


def _stop_all_on_failure(procs) -> None:
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return
        time.sleep(0.5)


class _Barrier:
    """All peers reach the same point before any goes on (a TCPStore, not a process group:
    each peer's DeepSpeed engine must see a world of one)."""

    def __init__(self, peer: int, peers: int, port: int):
        self.peer, self.peers, self.count = peer, peers, 0
        self.store = None
        if peers > 1:
            import datetime

            from torch.distributed import TCPStore
            self.store = TCPStore("127.0.0.1", port, peers, peer == 0,
                                  timeout=datetime.timedelta(seconds=600))

    def __call__(self) -> None:
        if self.store is None:
            return
        self.count += 1
        key = f"barrier{self.count}"
        if self.store.add(key, 1) == self.peers:
            self.store.set(key + "/go", "1")
        self.store.wait([key + "/go"])

    def gather(self, values: list) -> Optional[list]:
        """Every peer's ``values``, by peer, on peer 0 (None on the others); one process: its own."""
        if self.store is None:
            return [values]
        self.count += 1
        key = f"gather{self.count}"
        self.store.set(f"{key}/{self.peer}", json.dumps(values))
        if self.peer != 0:
            return None
        return [json.loads(self.store.get(f"{key}/{p}")) for p in range(self.peers)]

    def close(self, timeout: float = 600.0) -> None:
        """Peer 0 serves the store: it leaves only once every peer is past its last wait (else
        a peer still reading the last "go" loses the connection: seen when another process
        slowed one peer down)."""
        if self.store is None:
            return
        self.store.add("closed", 1)
        if self.peer == 0:
            deadline = time.monotonic() + timeout
            while self.store.add("closed", 0) < self.peers and time.monotonic() < deadline:
                time.sleep(0.01)


def _engine_worker(path: Path, device: str, todo=ENGINE_SHAPES, peer: int = 0, peers: int = 1,
                   port: int = 0, zero: int = 0, mp: int = 1) -> int:

    import deepspeed
    import torch

    from .sweep import pick_threads
    torch.set_num_threads(pick_threads(None, device) or torch.get_num_threads())
    if device.startswith("cuda"):
        device = f"cuda:{peer}"
        torch.cuda.set_device(peer)
    deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo")
    barrier = _Barrier(peer, peers, port)
    data = json.loads(path.read_text()) if path.is_file() else {}
    section = "zero" if zero else "tp" if mp > 1 else "shapes"
    shapes = data.setdefault(section, {})
    data["device"] = device
    data["zero_processes" if zero else "tp_processes" if mp > 1 else "processes"] = peers
    # every peer read the same file: the same sweeps are left for all of them (decided on what
    # the file held at the start, which only peer 0 rewrites)
    plan = sweep_plan(todo, {label: sweeps_done(row) for label, row in shapes.items()})
    probe = _reference_probe(device) if peer == 0 else None
    grids: dict = {}  # the tensor-parallel pass's groups, made once (parallel_groups)
    if probe is not None:
        data["reference"] = {"description": probe.describe(), "dtype": probe.dtype, "loops": probe.loops}
    for sweep, shape, layers in plan:
        label = engine_label(shape, layers)
        speed = _reference_reading(probe, barrier)
        if zero:
            row = _measure_zero(shape, layers, device, barrier, peers, zero)
        else:
            # the plain pass's peers are each a world of one; the tensor-parallel pass's, one
            row = _measure_engine(shape, layers, device, barrier, mp=mp,
                                  world=peers if mp > 1 else 1, grids=grids)
        if peer == 0:
            if speed is not None:
                row["speeds"] = [speed]
            old = shapes.get(label)
            shapes[label] = {**row, "sweeps": 1} if old is None else pooled(old, row, bool(zero))
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)  # a kill loses at most the shape-sweep in flight
            what = f"ZeRO-{zero} " if zero else f"mp {mp} " if mp > 1 else ""
            print(progress_line(measured=f"{what}{label}", sweep=sweep + 1,
                                complete=shapes[label]["sweeps"] >= ENGINE_SWEEPS), flush=True)
    barrier.close()
    import torch.distributed as dist
    if dist.is_initialized():
        # gloo's threads must stop before the interpreter does (else abort at exit), and no
        # peer may tear the group down while another is still in a collective
        dist.barrier()
        dist.destroy_process_group()
    return 0


# The machine's speed beside each shape-sweep: the calibration's fixed reference
# (calibration/disturbance.Probe) read by peer 0 before the shape's sweep while the other peers
# wait at a barrier, its cost per loop stored with the row ("speeds", one per sweep) for the
# fit to bring the repeats to one speed (neox_perf/profile/one_speed.py). A CPU's only: on a GPU
# the reference would run on the device the peers train on. READING_DTYPE: the CPU
# calibration's (calibration/sweep.pick_dtype); the fit uses the readings only where the
# operator step's reference ran in the same one.
READING_DTYPE, READINGS = "fp32", 3


def _reference_probe(device: str):
    if not device.startswith("cpu"):
        return None
    from .disturbance import Probe
    try:
        return Probe(device, READING_DTYPE)
    except Exception:  # noqa: BLE001 - a reading is information, never a reason to fail the step
        return None


def _reference_reading(probe, barrier) -> Optional[float]:
    """Every peer calls it (the barriers must match); peer 0, holding ``probe``, reads (None:
    no probe, or the reading failed)."""
    if barrier.peers > 1:
        barrier()
    try:
        return probe.seconds_per_loop(READINGS) if probe is not None else None
    except Exception:  # noqa: BLE001 - see _reference_probe
        return None
    finally:
        if barrier.peers > 1:
            barrier()


def _engine_for(keys: dict, vocab: int, device: str, world: int, grids: Optional[dict] = None):
    """The reference model of NeoX ``keys`` under a DeepSpeed engine on ``device``:
    (cfg, workload dims, torch device, model, trainable params, engine, device sync). With
    ``model_parallel_size`` > 1 in ``keys``, the ``world`` processes are split into
    tensor-parallel groups as workload/train.py splits them (DeepSpeed's topology, the mpu
    handed to the engine), made once per ``grids`` (the caller's, for the life of its process
    group: tensor_parallel.parallel_groups)."""
    import tempfile

    import deepspeed
    import torch

    from .workload import dims
    from .workload.ds_config import build_ds_config
    from .workload.model import SequentialModel
    from .workload.tensor_parallel import TPState, parallel_groups, set_tp_state
    from neox_perf.config import WorldRequest, build, load_files

    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "engine.yml"
        cfg_path.write_text(json.dumps(keys))
        cfg, _, _ = build(load_files([str(cfg_path)]), WorldRequest(gpus=world))
    dev = torch.device(device)
    wc = dims.from_neox(cfg, vocab)
    mpu = None
    if wc.mp > 1:
        _, _, mpu = parallel_groups(1, wc.mp, world // wc.mp, wc.fp32_allreduce, str(dev), grids)
    else:
        set_tp_state(TPState(init_device=str(dev)))
    model = SequentialModel(wc, 0).to(dev)
    ds_config, _ = build_ds_config(cfg, dev.type)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config,
                                           mpu=mpu)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    return cfg, wc, dev, model, params, engine, sync


def _measure_engine(shape, layers: int, device: str, barrier=lambda: None, mp: int = 1,
                    world: int = 1, grids: Optional[dict] = None) -> Dict[str, object]:
    """One shape's phases (the plain pass; with ``mp`` > 1 the tensor-parallel pass, where
    each rank runs its share of every layer and the layers' all-reduces run inside them)."""
    import torch

    from .workload import tensor_parallel
    from .workload.data import SyntheticTokens
    from .workload.ds_config import run_precision
    from .workload.layers import ParallelTransformerLayerPipe
    from .workload.model import cross_entropy

    keys, vocab = engine_keys(shape, layers, mp=mp), shape[-1]
    cfg, wc, dev, model, params, engine, sync = _engine_for(keys, vocab, device, world, grids)
    now = time.perf_counter
    clock, marks = PhaseClock(), []
    # the tensor-parallel all-reduces' own time (inclusive in the layers: not a PhaseClock
    # phase, which would take it out of the layer that runs it)
    allreduce = [0.0]
    plain_all_reduce = tensor_parallel._all_reduce

    def timed_all_reduce(x):
        t0 = now()
        try:
            return plain_all_reduce(x)
        finally:
            allreduce[0] += now() - t0
    if mp > 1:
        tensor_parallel._all_reduce = timed_all_reduce

    def stamp(kind):
        def hook(grad):
            sync()
            marks.append((kind, now()))
        return hook

    def timed_layer(forward):
        # forward time directly; backward between the gradient reaching the layer's output and
        # leaving through its input (tensor hooks: the layers take a tuple, module hooks miss it)
        def run(args):
            out = forward(args)
            if torch.is_grad_enabled():
                out[0].register_hook(stamp("start"))
                args[0].register_hook(stamp("end"))
            return out
        return clock.wrap("layer_forward", run)

    for module in model.sequential:
        if isinstance(module, ParallelTransformerLayerPipe):
            module.forward = timed_layer(module.forward)
    engine.allreduce_gradients = clock.wrap("flatten", engine.allreduce_gradients)
    data = SyntheticTokens(wc.seed, vocab, wc.seq_length, cfg.training.micro_batch_size, 0, dev)
    rows = []
    repeats = TP_REPEATS if mp > 1 else ENGINE_REPEATS
    try:
        for it in range(ENGINE_WARMUP + repeats):
            inputs, labels = data.micro_batch(it, 0)
            clock.current, marks[:], allreduce[0] = {}, [], 0.0
            barrier()
            t0 = now()
            loss = cross_entropy(engine(inputs), labels)
            sync()
            t1 = now()
            forward_allreduce = allreduce[0]
            barrier()
            t1b = now()
            engine.backward(loss)
            sync()
            t2 = now()
            barrier()
            t2b = now()
            engine.step()
            sync()
            t3 = now()
            flatten = clock.current.get("flatten", 0.0)
            starts = [t for kind, t in marks if kind == "start"]
            ends = [t for kind, t in marks if kind == "end"]
            row = {"forward": t1 - t0, "layer_forward": clock.current.get("layer_forward", 0.0),
                   "backward": t2 - t1b - flatten,
                   "layer_backward": sum(e - b for b, e in zip(starts, ends)),
                   "flatten": flatten, "step": t3 - t2b}
            if mp > 1:
                row.update(allreduce_forward=forward_allreduce,
                           allreduce_backward=allreduce[0] - forward_allreduce)
            rows.append(row)
    finally:
        tensor_parallel._all_reduce = plain_all_reduce
    timed = rows[ENGINE_WARMUP:]
    best = fastest(timed)
    # What AccumulateGrad does for every micro-batch after the first: grad += new gradient.
    for p in params:
        p.grad = torch.zeros_like(p)
    fresh = [torch.randn_like(p) for p in params]
    times = []
    for _ in range(repeats):
        sync()
        barrier()
        t0 = now()
        for p, g in zip(params, fresh):
            p.grad.add_(g)
        sync()
        times.append(now() - t0)
    best["accumulate"] = min(times)
    for r, t in zip(timed, times):
        r["accumulate"] = t
    gather = getattr(barrier, "gather", None)
    if mp == 1 and gather is not None:  # the plain pass: its peers' lockstep repeats side by side
        peers = gather([r["forward"] + r["backward"] for r in timed])
        if peers is not None and len(peers) > 1:
            peer_arrivals(timed, peers)
    counts = {"params": int(sum(p.numel() for p in params)), "tensors": len(params)}
    del engine, model, params, fresh
    # every timed repeat beside the fastest: the fit takes the statistic it needs
    # (predictors/fitting/engine_fit.typical_row)
    group = {"model_parallel_size": mp, "processes": world} if mp > 1 else {}
    return {"keys": keys, "vocab": vocab, "layers": layers, **group,
            "precision": run_precision(cfg, dev.type), **counts, **best, "repeats": timed}


# Each shape's row keeps every phase's fastest repeat (a data-parallel collective: its median,
# the fastest beside it as KEY_best) and, under "repeats", every timed repeat: the fit takes the
# statistic it needs (predictors/fitting/engine_fit.typical_row: the median, since a prediction
# is for the typical iteration; engine_fit pools the collectives' repeats across shapes of one
# size). A data-parallel collective is not one rank's work: it moves at the pace of both
# processes and of gloo's threads, which share the cores with them, and its repeats spread far
# wider (2-4x) than a rank's own phases.
ZERO_COLLECTIVES = ("allreduce", "allgather")


# Per repeat of the plain pass, over its peers (peer 0 stores them): each peer's forward +
# backward, as "busy" their mean and as "arrival" the slowest's lead over it -- what replicas
# that met before that work would wait for each other at a gradient all-reduce after it
# (engine_fit's dp_arrival). Not a phase: no fastest of them in the row.
PEER_KEYS = ("busy", "arrival")


def fastest(rows: List[Dict[str, float]]) -> Dict[str, float]:
    """Per key of a pass's timed repeats, the fastest: the rank's own work at its least
    disturbed (the plain and tensor-parallel passes' rows, and the ZeRO pass's own phases)."""
    if not rows:
        raise ValueError("no timed repeats")
    return {k: min(r[k] for r in rows) for k in rows[0] if k not in PEER_KEYS}


def peer_arrivals(rows: List[Dict[str, float]], peers: List[List[float]]) -> None:
    """Adds PEER_KEYS to each timed repeat from every peer's forward + backward of it."""
    for i, row in enumerate(rows):
        times = [p[i] for p in peers]
        mean = sum(times) / len(times)
        row["busy"], row["arrival"] = mean, max(times) - mean


def zero_statistics(rows: List[Dict[str, float]]) -> Dict[str, float]:
    """Per key of the ZeRO pass's timed repeats: the fastest for the rank's own work, the
    median for the data-parallel collectives (and their fastest as KEY_best)."""
    out = fastest(rows)
    for k in ZERO_COLLECTIVES:
        if k in out:
            out[f"{k}_best"] = out[k]
            out[k] = float(statistics.median(r[k] for r in rows))
    return out


def _measure_zero(shape, layers: int, device: str, barrier, world: int, stage: int) -> Dict[str, object]:
    """One shape under DeepSpeed's ZeRO optimizer, data parallel over the ``world`` peers.

    Timed apart, as predictors/fitting/engine_fit.py fits them: the gradient reduction at the accumulation
    boundary (engine.allreduce_gradients) and the optimizer step, each split into the time
    inside its data-parallel collectives -- the all-reduce of the whole gradient, the
    all-gather of the updated parameters -- and the rest, the optimizer's own work. A
    one-element all-reduce (the gradient norm) stays with the rest: it is where the step
    waits for the other ranks, as it does in training."""
    import deepspeed.comm as ds_comm

    from .workload.data import SyntheticTokens
    from .workload.ds_config import run_precision
    from .workload.model import cross_entropy

    keys, vocab = engine_keys(shape, layers, zero=stage), shape[-1]
    cfg, wc, dev, model, params, engine, sync = _engine_for(keys, vocab, device, world)
    counts = {"params": int(sum(p.numel() for p in params)), "tensors": len(params)}
    clock = PhaseClock()
    sizes: Dict[str, int] = {}

    def collective(name, fn):
        timed = clock.wrap(name, fn)

        def run(*args, **kwargs):
            tensor = kwargs.get("input_tensor", kwargs.get("tensor"))
            if tensor is None:
                tensor = args[1] if name == "allgather" else args[0]
            if tensor.numel() <= 1:
                return fn(*args, **kwargs)
            sizes[name] = int(tensor.numel())  # per rank: the reduced tensor, the gathered chunk
            return timed(*args, **kwargs)
        return run

    originals = {n: getattr(ds_comm, n) for n in ("all_reduce", "all_gather_into_tensor")}
    ds_comm.all_reduce = collective("allreduce", originals["all_reduce"])
    ds_comm.all_gather_into_tensor = collective("allgather", originals["all_gather_into_tensor"])
    engine.allreduce_gradients = clock.wrap("reduce", engine.allreduce_gradients)
    engine.step = clock.wrap("step", engine.step)
    data = SyntheticTokens(wc.seed, vocab, wc.seq_length, cfg.training.micro_batch_size,
                           int(os.environ.get("RANK", "0")), dev)
    rows = []
    try:
        for it in range(ENGINE_WARMUP + ENGINE_REPEATS):
            inputs, labels = data.micro_batch(it, 0)
            barrier()
            loss = cross_entropy(engine(inputs), labels)
            sync()
            barrier()
            clock.current = {}
            engine.backward(loss)
            sync()
            barrier()
            reduce = dict(clock.current)
            clock.current = {}
            engine.step()
            sync()
            step = dict(clock.current)
            rows.append({"reduce": reduce.get("reduce", 0.0), "allreduce": reduce.get("allreduce", 0.0),
                         "step": step.get("step", 0.0), "allgather": step.get("allgather", 0.0)})
    finally:
        ds_comm.all_reduce = originals["all_reduce"]
        ds_comm.all_gather_into_tensor = originals["all_gather_into_tensor"]
    timed = rows[ENGINE_WARMUP:]
    best = zero_statistics(timed)
    partition = getattr(engine.optimizer, "partition_size", None)
    del engine, model, params
    return {"keys": keys, "vocab": vocab, "layers": layers, "zero_stage": stage,
            "precision": run_precision(cfg, dev.type), "processes": world, **counts,
            "partition": int(sum(partition)) if partition else -(-counts["params"] // world),
            "allreduce_elements": sizes.get("allreduce", 0),
            "allgather_elements": sizes.get("allgather", 0), **best, "repeats": timed}


def main(argv: Optional[List[str]] = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("path", help="engine measurements JSON (resumed)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", help="JSON list of engine shapes (default: ENGINE_SHAPES)")
    parser.add_argument("--peer", type=int, default=0, help="this process among --peers")
    parser.add_argument("--peers", type=int, default=1, help="processes measuring in lockstep")
    parser.add_argument("--barrier-port", type=int, default=0, help="peer 0's TCPStore port")
    parser.add_argument("--zero", type=int, default=0,
                        help="ZeRO stage: the peers form one data-parallel group (the ZeRO pass)")
    parser.add_argument("--mp", type=int, default=1,
                        help="tensor-parallel group size: the peers form groups of it (the mp pass)")
    args = parser.parse_args(argv)
    shapes = tuple(tuple(s) for s in json.loads(args.shapes)) if args.shapes else ENGINE_SHAPES
    return _engine_worker(Path(args.path), args.device, shapes, args.peer, args.peers,
                          args.barrier_port, args.zero, args.mp)


if __name__ == "__main__":
    from .launch import exit_rank
    exit_rank(main())
