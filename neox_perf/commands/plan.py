"""`neox-perf plan`: rank the layouts NeoX and DeepSpeed would accept for a model on given GPUs."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from .. import exitcodes
from ..errors import UsageError
from .argtypes import count as _count, fraction as _fraction, gpu_counts as _gpus


def add_arguments(parser) -> None:
    """The `plan` subcommand's arguments (cli.py calls this on its subparser)."""
    parser.add_argument("configs", nargs="+", metavar="CONFIG",
                        help="NeoX YAML files, merged in order as deepy.py does")
    parser.add_argument("-d", "--conf-dir", help="directory prefixed to every CONFIG (deepy.py -d)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key after the merge, as check --set")
    parser.add_argument("--gpus", required=True, type=_gpus,
                        help="total GPUs of the job, or a comma-separated list (e.g. 64,96,128)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node (default: the cluster's)")
    parser.add_argument("--cluster", required=True,
                        help="a bundled profile or description by name (`neox-perf clusters`), a "
                             "profile directory, or your cluster description YAML")
    parser.add_argument("--vocab-size", type=int,
                        help="raw tokenizer vocabulary, when the tokenizer file is not readable here")
    parser.add_argument("--memory-headroom", type=_fraction, default=0.9, metavar="FRACTION",
                        help="share of the GPU's usable memory a layout's predicted device total "
                             "(allocator reserve, CUDA context and NCCL included) may use "
                             "(default 0.9: a margin for what the prediction cannot know)")
    parser.add_argument("--global-batch", type=int, metavar="SAMPLES",
                        help="global batch to keep (default: the config's train_batch_size, else "
                             "its micro x accumulation x dp at the first --gpus)")
    parser.add_argument("--max-micro-batch", type=int, metavar="N",
                        help="largest train_micro_batch_size_per_gpu to try (default: any)")
    parser.add_argument("--top", type=_count, default=10,
                        help="rows to show and candidates in --json (default 10; 0: all)")
    parser.add_argument("--write", metavar="FILE",
                        help="write the best layout as a NeoX YAML overlay of the keys that change")
    parser.add_argument("--json", action="store_true", help="print one versioned JSON envelope")


@dataclass
class PlanResult:
    plan: object  # neox_perf.plan.Plan
    files: List[str]
    profile_name: Optional[str]
    facts: object
    top: int
    written: Optional[str] = None
    overlay: dict = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)
    profile_warnings: List[str] = field(default_factory=list)  # a disturbed calibration's
    command: str = "plan"
    render_hint: str = "plan_text"

    @property
    def exit_code(self) -> int:
        if self.plan.admissible:
            return exitcodes.OK
        # Nothing admissible: a failed verdict when layouts NeoX accepts exist but none fits
        # memory (as check's out_of_memory), an invalid config when NeoX accepts none.
        if self.plan.rejected.get("out_of_memory"):
            return exitcodes.VERDICT_FAILED
        return exitcodes.INVALID_CONFIG

    @property
    def shown(self) -> list:
        cands = self.plan.candidates
        return cands if self.top == 0 else cands[:self.top]

    @property
    def baseline(self):
        """The user's layout at the first GPU count where NeoX builds it."""
        return next((b for b in self.plan.baselines if b.candidate is not None),
                    self.plan.baselines[0] if self.plan.baselines else None)

    def to_dict(self) -> dict:
        p, f = self.plan, self.facts
        out = {
            "files": list(self.files),
            "cluster": {"profile": self.profile_name, "gpu": f.gpu_name,
                        "gpu_memory_bytes": f.gpu_memory_bytes, "gpus_per_node": f.gpus_per_node},
            "gpus": list(p.gpus),
            "global_batch": p.global_batch,
            "global_batch_source": p.global_batch_source,
            "train_iters": p.train_iters,
            "memory_headroom": p.memory_limit,
            "evaluated": p.evaluated,
            "predicted": p.predicted,
            "admissible": p.admissible,
            "bounded": p.bounded,
            "duplicates": p.duplicates,
            "collapsed": p.collapsed,
            "within_interval": p.within_interval,
            "rejected": dict(p.rejected),
            "seconds": p.seconds,
            "baseline": _baseline(self.baseline),
            "baselines": [_baseline(b) for b in p.baselines],
            "candidates": [candidate_dict(c) for c in self.shown],
            "pareto_front": [candidate_dict(c) for c in p.candidates if c.pareto],
            "no_layout": {str(k): v for k, v in p.no_layout.items()},
            "written": self.written,
            "overlay": {k.replace("_", "-"): v for k, v in self.overlay.items()},
            "warnings": list(self.warnings),
            "profile_warnings": list(self.profile_warnings),
        }
        if not p.admissible:
            out["error"] = {"message": " | ".join(p.no_layout.values())}
        return out


def candidate_dict(c) -> dict:
    l = c.layout
    return {
        "rank": c.rank,
        "gpus": l.gpus,
        "layout": {
            "pipe_parallel_size": l.pipe_parallel_size,
            "model_parallel_size": l.model_parallel_size,
            "data_parallel_size": l.data_parallel_size,
            "train_micro_batch_size_per_gpu": l.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": l.gradient_accumulation_steps,
            "checkpoint_activations": l.checkpoint_activations,
            "zero_stage": l.zero_stage,
            "pipe_partition_method": l.pipe_partition_method,
        },
        "train_batch_size": l.train_batch_size,
        "batch_difference": c.batch_difference,
        "iteration_seconds": c.iteration_seconds,
        "interval_seconds": list(c.interval_seconds) if c.interval_seconds else None,
        "tokens_per_second": c.tokens_per_second,
        "mfu": c.mfu,
        "run_hours": None if c.run_seconds is None else c.run_seconds / 3600.0,
        "gpu_hours": c.gpu_hours,
        "fits": c.fits,
        "max_memory_fraction": c.max_memory_fraction,
        "dominant": c.dominant,
        "tp_across_nodes": c.tp_across_nodes,
        "pareto": c.pareto,
        "equivalent": [{"pipe_partition_method": e.pipe_partition_method, "zero_stage": e.zero_stage}
                       for e in c.equivalent],
    }


def _baseline(b) -> Optional[dict]:
    if b is None:
        return None
    if b.candidate is not None:
        out = candidate_dict(b.candidate)
        out["rank"] = b.rank
    else:
        out = {"rank": None, "gpus": b.gpus, "layout": None}
    out["reason"] = b.reason
    out["note"] = b.note
    return out


def run_plan(args) -> PlanResult:
    from ..config import load_files, raw_vocab
    from ..plan import Planner
    from ..prediction.predict import load_cluster
    from ..profile.disturbance import profile_warnings
    profile = load_cluster(args.cluster)
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise UsageError("--gpus-per-node must be at least 1")
    if args.global_batch is not None and args.global_batch < 1:
        raise UsageError("--global-batch must be at least 1")
    if args.max_micro_batch is not None and args.max_micro_batch < 1:
        raise UsageError("--max-micro-batch must be at least 1")
    from ..config.loader import apply_sets
    raw = apply_sets(load_files(args.configs, conf_dir=args.conf_dir), args.sets)
    vocab_source = raw.sources.get("vocab_file")
    search = [os.path.dirname(vocab_source)] if vocab_source else []
    values = raw.values
    from ..config.neox_keys import KEYS
    vocab = raw_vocab(str(values.get("tokenizer_type") or KEYS["tokenizer_type"][1]),
                      values.get("vocab_file"), args.vocab_size, search)
    planner = Planner(raw, profile, vocab.size, memory_limit=args.memory_headroom,
                      gpus_per_node=args.gpus_per_node, global_batch=args.global_batch,
                      max_micro_batch=args.max_micro_batch, keep=args.top)
    plan = planner.run(args.gpus)
    result = PlanResult(plan=plan, files=list(raw.files), profile_name=profile.name,
                        facts=profile.facts, top=args.top, warnings=list(raw.warnings),
                        profile_warnings=profile_warnings(profile))
    if plan.candidates:
        best = plan.candidates[0]
        result.overlay = planner.overrides(best.layout)
        if args.write:
            result.written = write_overlay(args.write, result.overlay, best, raw.files,
                                           result.profile_name)
    return result


def write_overlay(path: str, overlay: dict, best, files, cluster: Optional[str]) -> str:
    """The best layout as a NeoX YAML file to merge after the user's files. Keys are written
    dashed: NeoX (and check) refuse a key repeated verbatim in a later file but let the other
    spelling override it."""
    import yaml
    base = os.path.basename(path)
    if any(os.path.basename(f) == base for f in files):
        raise UsageError(f"--write {path}: has the same file name as a config; NeoX refuses two "
                         f"config files with one name (fix: choose another name)")
    l = best.layout
    head = (f"# neox-perf plan: the best predicted layout on {l.gpus} GPUs ({cluster}):\n"
            f"# pipe {l.num_stages} x model {l.model_parallel_size} x data {l.data_parallel_size}, "
            f"micro {l.train_micro_batch_size_per_gpu} x accumulation "
            f"{l.gradient_accumulation_steps}, {best.iteration_seconds:.3f} s per iteration.\n"
            f"# Merge after: {' '.join(files)}   (e.g. neox-perf check ... {base} --gpus {l.gpus})\n")
    body = yaml.safe_dump({k.replace("_", "-"): v for k, v in overlay.items()},
                          sort_keys=False, default_flow_style=False) if overlay else "{}\n"
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(head + body)
    except OSError as exc:
        raise UsageError(f"--write {path}: cannot write ({exc.strerror or exc.__class__.__name__}) "
                         f"(fix: choose a writable path)")
    return path
