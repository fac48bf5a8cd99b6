"""Advice from the cause: what to change when a layout does not fit, fights the hardware, or
leaves time on the table, as verdicts and a layout ready to paste.

- Out of memory: the fix follows the term that dominates the peak (model states: shard or split
  them; activations: checkpoint, smaller micro-batches), and the fastest layout that fits comes
  from the planner (`neox_perf.plan`, its quick search around the user's layout).
- Tensor parallelism across nodes, uneven pipeline stages, and a layout far slower than the best
  the quick search finds are warnings that say what share of the step they cost.
- A tokenizer vocabulary that was assumed, not read, is a warning.
The planner runs only where a verdict needs it (out of memory, or a step that loses a large
share to communication, the bubble or uneven stages), so a plain `check` stays fast.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .config.specs import NeoxConfig
from .config.verdicts import Verdict

GIB = 2 ** 30
# A step losing half or more to anything but compute is worth a search for a better layout
SEARCH_WHEN_LOST = 0.5
# ... and a layout this much faster (seconds per batch) is worth a warning
FAR_FASTER = 1.25
# Uneven stages costing this share of the step are worth a warning
IMBALANCE_SHARE = 0.10


# -- memory ----------------------------------------------------------------------------------

def memory_terms(mem) -> Dict[str, float]:
    """Bytes of the peak (the larger of backward and optimizer step) by term, largest first."""
    states = {"weights": mem.weights, "gradients": mem.gradients,
              "optimizer": mem.master_weights + mem.optimizer_states}
    if mem.backward_peak >= mem.step_peak:
        moving = {"activations": (mem.activations + mem.recompute + mem.embedding + mem.logits
                                  + mem.pipe_buffers)}
        other = max(mem.backward_peak - sum(states.values()) - moving["activations"], 0)
    else:
        moving = {"optimizer step": mem.step_transient}
        other = max(mem.step_peak - sum(states.values()) - mem.step_transient, 0)
    out = dict(states, **moving, buffers=other)
    return dict(sorted(((k, float(v)) for k, v in out.items() if v > 0), key=lambda kv: -kv[1]))


def memory_fix(cfg: NeoxConfig, mem) -> Tuple[str, str]:
    """(the key to change, one line), from the stage's peak: the remedy for the dominant term."""
    terms = memory_terms(mem)
    states = sum(terms.get(k, 0.0) for k in ("weights", "gradients", "optimizer"))
    moving = terms.get("activations", 0.0)
    t, p = cfg.training, cfg.parallel
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in terms.items() if v >= 0.05 * GIB)
    if states >= moving:
        fixes = []
        key = "pipe_parallel_size"
        if t.zero_stage == 0 and p.data_parallel_size > 1:
            key = "zero_optimization"
            fixes.append(f"ZeRO stage 1 (zero_optimization.stage=1) shards the "
                         f"{terms.get('optimizer', 0.0) / GIB:.1f} GiB of fp32 master and optimizer "
                         f"states over the {p.data_parallel_size} data-parallel ranks")
        fixes.append("more pipeline stages (pipe_parallel_size) or tensor parallelism "
                     "(model_parallel_size) divide weights, gradients and optimizer states alike")
        return key, f"model states dominate ({parts} GiB): " + "; ".join(fixes)
    fixes = []
    if not t.checkpoint_activations:
        fixes.append("enable checkpoint_activations (keeps one input per layer)")
    if t.micro_batch_size > 1:
        fixes.append(f"lower train_micro_batch_size_per_gpu from {t.micro_batch_size} (raise "
                     f"gradient_accumulation_steps to keep the batch)")
    if p.model_parallel_size > 1 and t.checkpoint_activations and not t.partition_activations:
        fixes.append("partition_activations splits the checkpoints over the tensor-parallel ranks")
    fixes.append("more tensor parallelism divides a layer's activations")
    key = "train_micro_batch_size_per_gpu" if t.checkpoint_activations else "checkpoint_activations"
    return key, f"activations dominate ({parts} GiB): " + "; ".join(fixes)


# -- the hardware ----------------------------------------------------------------------------

def tensor_parallel_verdicts(cfg: NeoxConfig, estimate=None) -> List[Verdict]:
    """Tensor parallelism whose group spans nodes: its all-reduces (two per layer in forward,
    two in backward) leave NVLink for the inter-node network."""
    from .prediction.operators import tensor_parallel_placement
    p = cfg.parallel
    mp, gpn = p.model_parallel_size, p.gpus_per_node
    if mp <= 1:
        return []
    nodes, _ = tensor_parallel_placement(mp, gpn)
    if nodes <= 1:
        return []
    share = ""
    if estimate is not None and estimate.iteration_seconds > 0:
        tp = estimate.breakdown.get("mp_allreduce", 0.0) / estimate.iteration_seconds
        share = f"; its all-reduces take {tp:.0%} of the predicted step"
    fit = max(d for d in range(1, gpn + 1) if gpn % d == 0 and mp % d == 0)
    return [Verdict("tensor_parallel_across_nodes", "warning",
                    f"tensor parallelism {mp} spans {nodes} nodes of {gpn} GPUs: every layer's "
                    f"all-reduces cross the inter-node network{share}", key="model_parallel_size",
                    file=cfg.sources.get("model_parallel_size"),
                    fix=f"keep model_parallel_size within a node (at most {gpn}, e.g. {fit}) and "
                        f"add pipeline stages instead")]


def imbalance_verdicts(cfg: NeoxConfig, derived, estimate) -> List[Verdict]:
    """Stages whose per-micro-batch work differs: 1F1B runs every micro-batch at the slowest
    stage's pace, so the gap to the mean costs m x (slowest - mean) of the step."""
    stages = estimate.stages
    if len(stages) < 2 or estimate.iteration_seconds <= 0:
        return []
    work = [s.forward + s.backward for s in stages]
    mean = sum(work) / len(work)
    slow = max(range(len(work)), key=work.__getitem__)
    m = cfg.training.gradient_accumulation_steps
    share = m * (work[slow] - mean) / estimate.iteration_seconds
    if share < IMBALANCE_SHARE:
        return []
    st, t = derived.stages[slow], stages[slow]
    layer = t.layer_forward + t.layer_backward + (t.recompute / st.transformer_layers
                                                  if st.transformer_layers else 0.0)
    extra = work[slow] - st.transformer_layers * layer
    blocks = sorted({s.transformer_layers for s in derived.stages})
    held = "the LM head and loss" if slow == len(stages) - 1 else (
        "the embedding" if slow == 0 else "more layers")
    weight = f" (with {held}, worth {extra / layer:.1f} layers)" if layer > 0 and extra > 0.5 * layer else ""
    return [Verdict("pipeline_imbalance", "warning",
                    f"pipeline stages are uneven: stage {slow} takes {work[slow] / mean:.2f}x the mean "
                    f"per micro-batch{weight}, with {'-'.join(map(str, (blocks[0], blocks[-1])))} "
                    f"transformer layers per stage; the gap costs ~{share:.0%} of the step",
                    key="pipe_parallel_size", file=cfg.sources.get("pipe_parallel_size"),
                    fix="fewer pipeline stages (more layers each, so the head weighs less), or "
                        "pipe_partition_method: parameters")]


def lost_share(estimate) -> float:
    """Share of the step that is not the critical stage's own compute (communication, the
    bubble, p2p, gradient sync, the update)."""
    c, b = estimate.timeline.components, estimate.breakdown
    compute = max(c.get("critical_compute_seconds", 0.0) - b.get("mp_allreduce", 0.0), 0.0)
    return 1.0 - compute / estimate.iteration_seconds if estimate.iteration_seconds > 0 else 0.0


# -- the tokenizer ---------------------------------------------------------------------------

def vocab_verdicts(cfg: NeoxConfig, vocab, derived=None) -> List[Verdict]:
    if not getattr(vocab, "assumed", False):
        return []
    share = ""
    if derived is not None and derived.params.unique:
        share = (f"; the embedding and LM head it sizes are {derived.params.embedding / derived.params.unique:.0%}"
                 f" of the parameters")
    return [Verdict("vocab_assumed", "warning",
                    f"the vocabulary is assumed, not read ({vocab.source}){share}",
                    key="vocab_file", file=cfg.sources.get("vocab_file"),
                    fix="pass --vocab-size N (the tokenizer's size), or make vocab_file readable here")]


# -- a better layout, from the planner --------------------------------------------------------

# More `--set` flags than this and a fix names `plan --write` instead (Suggestion.fix).
MAX_SET_FLAGS = 4


@dataclass
class Suggestion:
    """A layout the quick search found: the fastest that fits, or a faster one than the user's."""
    reason: str  # "fits": the user's layout does not | "faster": it does, this is faster
    candidate: object  # plan.Candidate
    overrides: Dict[str, object]  # normalised NeoX keys -> values that turn the config into it
    current: Dict[str, object]  # those keys' values in the user's config (NeoX defaults applied)
    searched: int  # layouts the quick search considered
    seconds: float  # what the search cost
    user_gpus: int  # the GPUs the user asked for (a layout that fits may need more)
    user_seconds_per_batch: Optional[float] = None

    @property
    def layout(self):
        return self.candidate.layout

    def where(self) -> str:
        """"on N GPUs " when the layout needs other GPUs than asked for, else ""."""
        return "" if self.layout.gpus == self.user_gpus else f"on {self.layout.gpus} GPUs "

    @property
    def speedup(self) -> Optional[float]:
        if not self.user_seconds_per_batch:
            return None
        return self.user_seconds_per_batch / self.candidate.seconds_per_batch

    def set_flags(self) -> str:
        """The overrides as `--set` flags (`check`/`plan` take them; a mapping key by entry),
        and `--gpus N` when the layout needs other GPUs than asked for."""
        out = [] if self.layout.gpus == self.user_gpus else [f"--gpus {self.layout.gpus}"]
        for key, value in self.overrides.items():
            old = self.current.get(key)
            if isinstance(value, dict):
                for k, v in value.items():
                    if not isinstance(old, dict) or old.get(k) != v:
                        out.append(f"--set {key}.{k}={_yaml(v)}")
            else:
                out.append(f"--set {key}={_yaml(value)}")
        return " ".join(out)

    @property
    def too_many_flags(self) -> bool:
        """More `--set` flags than a line is pasted right with: `plan --write` serves instead."""
        return self.set_flags().count("--set ") > MAX_SET_FLAGS

    def fix(self, files: Sequence[str], cluster: Optional[str], user_flags: str = "") -> str:
        """What to do to get this layout: the `--set` flags when they are few, else the `plan
        --write` command that writes them into a file (a ten-flag line is pasted wrong);
        `user_flags`: the flags of the user's own command that shape the model (CheckResult.
        request_flags), which the plan must see to search the same model."""
        flags = self.set_flags()
        if not self.too_many_flags:
            return flags
        return (f"{self.plan_command(files, cluster, user_flags)}, then add best.yml to your config "
                f"files ({flags.count('--set ')} keys change)")

    def plan_command(self, files: Sequence[str], cluster: Optional[str], user_flags: str = "",
                     write: bool = True) -> str:
        """`neox-perf plan` of the user's model (their files and the flags that shaped it) on
        this layout's GPUs; `write`: into best.yml."""
        return (f"neox-perf plan {' '.join(files)}{' ' + user_flags if user_flags else ''} "
                f"--gpus {self.layout.gpus} --cluster {cluster}" + (" --write best.yml" if write else ""))

    def describe(self) -> str:
        l = self.layout
        return (f"pp {l.pipe_parallel_size} x mp {l.model_parallel_size} x dp {l.data_parallel_size}, "
                f"micro-batch {l.train_micro_batch_size_per_gpu} x {l.gradient_accumulation_steps}, "
                f"checkpointing {'on' if l.checkpoint_activations else 'off'}, ZeRO {l.zero_stage}")

    def to_dict(self) -> dict:
        c = self.candidate
        return {"reason": self.reason, "gpus": self.layout.gpus, "overrides": dict(self.overrides),
                "set": self.set_flags(), "layout": self.describe(),
                "iteration_seconds": c.iteration_seconds,
                "interval_seconds": list(c.interval_seconds) if c.interval_seconds else None,
                "memory_fraction": c.max_memory_fraction,
                "run_hours": None if c.run_seconds is None else c.run_seconds / 3600.0,
                "gpu_hours": c.gpu_hours, "speedup": self.speedup,
                "searched_layouts": self.searched, "search_seconds": self.seconds}


def _yaml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _quick_planner(raw, cfg: NeoxConfig, profile, raw_vocab: int, gpus_per_node: Optional[int],
                   spare: bool = False):
    """The planner's quick search around cfg's layout, keeping cfg's global batch (spare: also
    micro-batch 1 and ZeRO 1, to fit); one planner's derivations and operator times carry
    over from one GPU count to the next."""
    from .plan import Planner, layout_of
    return Planner(raw, profile, raw_vocab, gpus_per_node=gpus_per_node,
                   global_batch=cfg.training.train_batch_size, keep=2, near=layout_of(cfg),
                   spare=spare)


def _suggestion(reason, plan, planner, started, user_gpus, user=None) -> Optional[Suggestion]:
    if not plan.candidates:
        return None
    best = plan.candidates[0]
    overrides = planner.overrides(best.layout)
    return Suggestion(reason=reason, candidate=best, overrides=overrides,
                      current={k: planner.value(k) for k in overrides}, searched=plan.evaluated,
                      seconds=time.perf_counter() - started, user_gpus=user_gpus,
                      user_seconds_per_batch=user)


# Bytes per parameter of mixed-precision Adam training: 16-bit weights and gradients, fp32
# master weights and two fp32 moments (ZeRO, Rajbhandari et al. 2020, section 3.1); fp32
# training holds the same 16 (weights, gradients, two moments).
STATE_BYTES_PER_PARAMETER = 16


def fewest_gpus(params: int, capacity: int, memory_limit: float = 0.9) -> int:
    """GPUs the model states alone need when every byte of them is sharded, each GPU filled to
    `memory_limit` of its capacity: a lower bound."""
    return max(1, -(-params * STATE_BYTES_PER_PARAMETER // int(memory_limit * capacity)))


def fitting_layout(raw, cfg: NeoxConfig, profile, raw_vocab: int, gpus_per_node=None,
                   params: Optional[int] = None,
                   tries: int = 2) -> Tuple[Optional[Suggestion], List[str]]:
    """The fastest layout that fits on cfg's GPUs; failing that, on the first doubling of them
    the model states could fit at all (`fewest_gpus`), then on twice that. Also the lines
    saying what excluded each count searched."""
    started = time.perf_counter()
    lines: List[str] = []
    gpus = cfg.parallel.world_size
    if params:
        least = fewest_gpus(params, profile.facts.gpu_memory_bytes)
        while gpus < least:
            gpus *= 2
    planner = _quick_planner(raw, cfg, profile, raw_vocab, gpus_per_node, spare=True)
    for _ in range(tries):
        plan = planner.run([gpus])
        found = _suggestion("fits", plan, planner, started, cfg.parallel.world_size)
        if found is not None:
            return found, lines
        lines.extend(plan.no_layout.values())
        gpus *= 2
    return None, lines


def faster_layout(raw, cfg: NeoxConfig, profile, raw_vocab: int, user_seconds: float,
                  gpus_per_node=None) -> Optional[Suggestion]:
    """A layout of the same GPUs the quick search predicts faster than the user's, or None."""
    started = time.perf_counter()
    from .plan import layout_of
    planner = _quick_planner(raw, cfg, profile, raw_vocab, gpus_per_node)
    plan = planner.run([cfg.parallel.world_size])
    found = _suggestion("faster", plan, planner, started, cfg.parallel.world_size, user=user_seconds)
    if found is None or found.layout == layout_of(cfg):
        return None
    return found


def faster_verdicts(suggestion: Optional[Suggestion], files: Sequence[str], cluster: str,
                    user_flags: str = "") -> List[Verdict]:
    if suggestion is None or (suggestion.speedup or 0.0) < FAR_FASTER:
        return []
    c = suggestion.candidate
    x = suggestion.speedup
    slower = f"{x:.1f}x as slow as" if x >= 2 else f"{x - 1.0:.0%} slower than"
    return [Verdict("slower_than_best_layout", "warning",
                    f"your layout is predicted {slower} {suggestion.describe()} "
                    f"({suggestion.user_seconds_per_batch:.3g} s vs {c.seconds_per_batch:.3g} s per "
                    f"iteration of the same batch)",
                    fix=(suggestion.fix(files, cluster, user_flags) if suggestion.too_many_flags
                         else f"{suggestion.set_flags()}; `"
                              f"{suggestion.plan_command(files, cluster, user_flags, write=False)}` "
                              f"ranks every layout"))]
