"""Collective benchmarks (all-reduce, all-gather, p2p) inside a real multi-process launch.

    torchrun --nproc_per_node N -m neox_perf.calibration.collectives --store S --sizes 65536 1048576
    deepspeed --num_gpus N --module neox_perf.calibration.collectives --store S --plan quick

Every rank runs this module; the launcher's RANK / WORLD_SIZE / LOCAL_RANK and
LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE (deepspeed) say where it sits. NCCL on CUDA,
gloo on CPU. For each group shape the world can form -- nodes x gpus_per_node, powers of
two up to the launch's own, as the published samples' 1_2 ... 8_1 files -- and each size,
the group's ranks time the collective; the per-repetition maximum over ranks (the last
rank to finish is when the collective is done) is aggregated like the operator benchmarks.
Only rank 0 opens the store; it decides which points are already stored and broadcasts
that, so every rank runs the same collectives in the same order and a re-run resumes.

Sizes are elements per rank as in opspec.collective_wire_bytes: the reduced tensor for
all-reduce, each rank's input chunk for all-gather, the tensor sent for p2p.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from neox_perf.prediction import opspec

from .launch import progress_line
from .store import COLLECTIVE_PHASE

Shape = Tuple[int, int]  # (nodes, gpus_per_node)


def _powers_up_to(n: int) -> List[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    if out[-1] != n:
        out.append(n)  # e.g. 6 GPUs per node: measure the full node too
    return out


def launch_layout(env=None) -> Tuple[int, int, int, int, int]:
    """(rank, world, local_rank, nodes, gpus_per_node) from the launcher's environment."""
    env = os.environ if env is None else env
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise LaunchError(f"{', '.join(missing)} not set: this module runs under a launcher, e.g. "
                          f"torchrun --nproc_per_node 2 -m neox_perf.calibration.collectives --store S")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", rank))
    gpn = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)
    if gpn < 1 or world % gpn:
        raise LaunchError(f"WORLD_SIZE {world} is not a multiple of the {gpn} processes per node")
    return rank, world, local_rank, world // gpn, gpn


def group_shapes(nodes: int, gpus_per_node: int, kind: str) -> List[Shape]:
    """The (nodes, members per node) groups to measure; p2p is always a pair."""
    shapes = [(n, g) for n in _powers_up_to(nodes) for g in _powers_up_to(gpus_per_node) if n * g >= 2]
    if kind == "p2p":
        shapes = [s for s in shapes if s[0] * s[1] == 2]
    return shapes


def group_ranks(shape: Shape, gpus_per_node: int) -> List[int]:
    """Global ranks of a group: the first `gpn` local ranks of the first `nodes` nodes."""
    nodes, gpn = shape
    return [node * gpus_per_node + i for node in range(nodes) for i in range(gpn)]


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Job:
    kind: str
    shape: Shape
    elements: int

    @property
    def features(self):
        return {"elements": self.elements, "nodes": self.shape[0], "gpus_per_node": self.shape[1]}

    @property
    def label(self) -> str:
        return f"{self.kind} {self.shape[0]}x{self.shape[1]} elements={self.elements}"


def plan_jobs(sizes: dict, nodes: int, gpus_per_node: int) -> List[Job]:
    """Deterministic job list: every rank must build the same one."""
    jobs = []
    for kind in opspec.COLLECTIVES:
        for shape in group_shapes(nodes, gpus_per_node, kind):
            for elements in sizes.get(kind, ()):
                jobs.append(Job(kind, shape, int(elements)))
    return jobs


def _time_one(job: Job, ranks: List[int], rank: int, group, tensors, clock, sync) -> float:
    import torch.distributed as dist
    dist.barrier(group=group)
    sync()
    t0 = clock()
    if job.kind == "allreduce":
        dist.all_reduce(tensors[0], group=group)
    elif job.kind == "allgather":
        inp, out = tensors
        if isinstance(out, list):  # gloo: no all_gather_into_tensor
            dist.all_gather(out, inp, group=group)
        else:
            dist.all_gather_into_tensor(out, inp, group=group)
    else:  # p2p: the first member sends to the second
        if rank == ranks[0]:
            dist.send(tensors[0], dst=ranks[1])
        else:
            dist.recv(tensors[0], src=ranks[0])
    sync()
    return clock() - t0


def measure_collectives(store_path, sizes: dict, *, warmup: int = 2, repeats: int = 5,
                    dtype: str = "auto", clock: Optional[Callable[[], float]] = None,
                    threads: Optional[int] = None, timeout_s: float = 600.0,
                    echo: Callable[[str], None] = print) -> int:
    """Measure every (collective, group shape, size) in this launch; rank 0 stores and echoes
    one progress line (launch.progress_line) per measured job. Returns the number of samples
    rank 0 wrote (0 on other ranks)."""
    rank, world, local_rank, nodes, gpn = launch_layout()  # before torch: fail fast

    import torch
    import torch.distributed as dist

    from .bench import DTYPES, aggregate
    from .fingerprint import fingerprint
    from .store import SampleStore

    cuda = torch.cuda.is_available()
    # Same thread rule as the operator calibration, so both land on one device id.
    from .sweep import pick_threads
    threads = pick_threads(threads, "cuda" if cuda else "cpu")
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # this process is ours alone
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dtype = ("fp16" if cuda else "fp32") if dtype == "auto" else dtype
    clock = clock or time.perf_counter
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        jobs = plan_jobs(sizes, nodes, gpn)
        # new_group is collective over the world: every rank creates every group, in order.
        groups = {}
        for shape in sorted({j.shape for j in jobs}):
            ranks = group_ranks(shape, gpn)
            groups[shape] = (ranks, dist.new_group(ranks))
        store = device_id = run_id = None
        todo = torch.ones(len(jobs), dtype=torch.int32, device=device)
        failure = None
        if rank == 0:
            try:
                store = SampleStore(store_path)
                device_id = store.register_device(fingerprint(str(device)))
                run_id = store.register_run("calibrate", device=device_id, plan="collectives", info={
                    "backend": backend, "world": world, "nodes": nodes, "gpus_per_node": gpn,
                    "dtype": dtype, "warmup": warmup, "repeats": repeats})
                for i, job in enumerate(jobs):
                    if store.has_sample(job.kind, COLLECTIVE_PHASE, job.features, device=device_id,
                                        dtype=dtype):
                        todo[i] = 0
            except Exception as exc:  # tell the other ranks instead of leaving them to time out
                failure = exc
                todo.fill_(-1)
        dist.broadcast(todo, src=0)
        if failure is not None:
            raise failure
        if len(jobs) and int(todo[0]) < 0:
            raise LaunchError("rank 0 could not open the sample store (see its message)")
        written = 0
        for i, job in enumerate(jobs):
            if not int(todo[i]):
                continue
            ranks, group = groups[job.shape]
            times = torch.zeros(repeats, dtype=torch.float64)
            if rank in ranks:
                tensors = _tensors(job, len(ranks), device, DTYPES[dtype], backend)
                for r in range(warmup + repeats):
                    t = _time_one(job, ranks, rank, group, tensors, clock, sync)
                    if r >= warmup:
                        times[r - warmup] = t
                del tensors
                # The collective is done when its slowest member is.
                times_dev = times.to(device)
                dist.all_reduce(times_dev, op=dist.ReduceOp.MAX, group=group)
                times = times_dev.cpu()
            if rank == 0:
                agg = aggregate(times.tolist())
                if agg.seconds > 0 and store.add_sample(
                        job.kind, COLLECTIVE_PHASE, job.features, agg.seconds, device=device_id,
                        run=run_id, dtype=dtype, repeats=agg.repeats, median=agg.median,
                        iqr=agg.iqr, min_seconds=agg.min,
                        info={"backend": backend, "q1": agg.q1, "q3": agg.q3, "times": list(agg.times),
                              "world": world}):
                    written += 1
                echo(progress_line(measured=job.label, seconds=agg.seconds, iqr=agg.iqr))
            dist.barrier()  # ranks outside the group wait here, so groups never overlap
        if rank == 0:
            store.finish_run(run_id, info={"backend": backend, "world": world, "nodes": nodes,
                                           "gpus_per_node": gpn, "dtype": dtype, "written": written})
            store.close()
        return written
    finally:
        dist.destroy_process_group()


def _tensors(job: Job, members: int, device, dtype, backend):
    import torch
    x = torch.ones(job.elements, device=device, dtype=dtype)
    if job.kind != "allgather":
        return (x,)
    if backend == "gloo":
        return x, [torch.empty_like(x) for _ in range(members)]
    return x, torch.empty(job.elements * members, device=device, dtype=dtype)


def torchrun_command(nproc_per_node: int, store, *, sizes: Sequence[int] = (), plan: Optional[str] = None,
                     master_port: Optional[int] = None, python: str = sys.executable) -> List[str]:
    """The single-node launch command (for the CLI to spawn)."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node)]
    if master_port is not None:
        cmd += ["--master_port", str(master_port)]
    cmd += ["-m", "neox_perf.calibration.collectives", "--store", str(store)]
    if plan:
        cmd += ["--plan", str(plan)]
    if sizes:
        cmd += ["--sizes", *map(str, sizes)]
    return cmd


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neox_perf.calibration.collectives",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="sample store (SQLite) rank 0 writes")
    parser.add_argument("--sizes", type=int, nargs="+", help="elements per rank, for every collective")
    parser.add_argument("--plan", help="plan name or YAML whose `collectives` section gives the sizes")
    parser.add_argument("--ops", nargs="+", choices=opspec.COLLECTIVES, default=list(opspec.COLLECTIVES))
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "fp16", "bf16"))
    parser.add_argument("--threads", type=int, help="torch CPU threads (match the operator calibration)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        warmup, repeats = 2, 5
        if args.plan:
            from .plan import load_plan
            plan = load_plan(args.plan)
            sizes = dict(plan.collectives)
            warmup, repeats = plan.collective_warmup, plan.collective_repeats
        else:
            sizes = {}
        if args.sizes:
            sizes = {kind: tuple(args.sizes) for kind in opspec.COLLECTIVES}
        sizes = {k: v for k, v in sizes.items() if k in args.ops}
        if not sizes:
            raise LaunchError("no sizes: pass --sizes N [N ...] or a --plan with a collectives section")
        if any(s < 1 for v in sizes.values() for s in v):
            raise LaunchError("sizes must be positive element counts")
        warmup = args.warmup if args.warmup is not None else warmup
        repeats = args.repeats if args.repeats is not None else repeats
        if warmup < 0 or repeats < 1:
            raise LaunchError("--warmup must be >= 0 and --repeats >= 1")
        echo = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
        measure_collectives(args.store, sizes, warmup=warmup, repeats=repeats, dtype=args.dtype,
                        threads=args.threads, echo=echo)
    except Exception as exc:  # one line per rank, never a traceback
        from neox_perf.errors import NeoxPerfError
        line = exc.line() if isinstance(exc, NeoxPerfError) else f"{exc.__class__.__name__}: {exc}"
        rank = os.environ.get("RANK", "?")
        sys.stderr.write(f"neox-perf collectives (rank {rank}): {' '.join(line.split())}\n")
        return 2 if isinstance(exc, LaunchError) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
