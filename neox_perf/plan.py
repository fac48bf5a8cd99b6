"""The layouts NeoX and DeepSpeed would accept for one model on given GPUs, ranked by predicted
time to train (the core of `neox-perf plan`; commands/plan.py only adapts the command line).

Every candidate is the user's merged config with a few keys replaced (`Planner.overrides`, the
same keys `--write` puts in the overlay), built by the same `config.build` as `check`, judged by
the same `checks.config_verdicts`, derived and predicted through `predict()`. What keeps a plan
of thousands of layouts within seconds:
- the layer list, DeepSpeed's partition and the per-stage parameter counts depend only on
  (model parallel, stages, partition method): computed once per such triple, with only memory,
  FLOPs and tokens redone per candidate (`SharedDerive`; a test holds it equal to `derive()` on
  every candidate of a plan); memory stops at the first stage over the memory limit
  (derive/fit.py, the rule check judges with);
- a layout is timed only if it can matter: a lower bound from its stage times (one transformer
  layer's operators, shared by every layout with the same model parallel and micro-batch) skips
  layouts that can reach neither the rows shown, nor a rank above the user's own layout, nor
  the time/GPU-hours Pareto front; the ranks of what is shown stay exact (a test compares a
  bounded plan with a fully timed one);
- operator and collective predictions are memoised per shape inside the cluster profile, and
  the timeline replays an instruction stream once for layouts that differ only after the last
  backward (ZeRO stage, data-parallel sync).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .config import WorldRequest, build
from .config.loader import RawConfig
from .config.neox_keys import KEYS, ZERO_DEFAULTS
from .errors import ConfigError, UsageError
from .profile.protocol import Profile

# DeepSpeed's partition methods that NeoX configs use; the user's own is always tried too.
PARTITION_METHODS = ("type:transformer|mlp", "parameters", "uniform")
# Config findings that do not depend on the layout: the plan stops on them as `check` would.
LAYOUT_CODES = {"heads_divisible_by_mp", "kv_heads_divisible_by_mp", "zero_with_model_parallel",
                "moe_zero", "batch_triple", "world_divisible"}
# Order in which a "no layout" line names the constraints (the order they are applied in).
REASON_ORDER = ("heads_divisible_by_mp", "kv_heads_divisible_by_mp", "mlp_divisible_by_mp",
                "stage_without_layers", "partition", "zero_with_model_parallel", "moe_zero",
                "config", "out_of_memory")


@dataclass(frozen=True)
class Layout:
    gpus: int
    pipe_parallel_size: int
    model_parallel_size: int
    data_parallel_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    checkpoint_activations: bool
    zero_stage: int
    pipe_partition_method: str

    @property
    def num_stages(self) -> int:
        return max(self.pipe_parallel_size, 1)

    @property
    def train_batch_size(self) -> int:
        return (self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps
                * self.data_parallel_size)

    def short(self) -> str:
        return f"{self.num_stages}-{self.model_parallel_size}-{self.data_parallel_size}"


def layout_of(cfg) -> Layout:
    p, t = cfg.parallel, cfg.training
    return Layout(p.world_size, p.pipe_parallel_size, p.model_parallel_size, p.data_parallel_size,
                  t.micro_batch_size, t.gradient_accumulation_steps, t.checkpoint_activations,
                  t.zero_stage, p.pipe_partition_method)


@dataclass
class Candidate:
    """One admissible layout with its prediction."""

    layout: Layout
    iteration_seconds: float
    interval_seconds: Optional[Tuple[float, float]]
    tokens_per_second: float
    mfu: Optional[float]
    max_memory_fraction: float
    fits: bool
    dominant: str  # the largest cost on the critical path, one word
    seconds_per_batch: float  # iteration time scaled to the plan's global batch (the rank key)
    run_seconds: Optional[float]  # train_iters x the plan's global batch
    gpu_hours: Optional[float]
    batch_difference: int  # this layout's global batch minus the plan's
    breakdown: Dict[str, float] = field(repr=False, default_factory=dict)
    rank: Optional[int] = None
    pareto: bool = False
    # layouts that differ from this one only in a setting that changes nothing predicted
    # (partition method, ZeRO stage): same time and memory, folded into this row (`collapse`)
    equivalent: List[Layout] = field(repr=False, default_factory=list)
    # its tensor-parallel group spans nodes: every layer's all-reduces cross the fabric, and
    # check warns on it (operators.tensor_parallel_placement places it for both)
    tp_across_nodes: bool = False

    @property
    def cost(self) -> float:
        """What the GPUs are busy for: run GPU-hours, or GPU-seconds per batch without train_iters."""
        return self.gpu_hours if self.gpu_hours is not None else self.seconds_per_batch * self.layout.gpus


@dataclass
class Baseline:
    """The user's own layout at one GPU count: a Candidate, or why it is not admissible."""

    gpus: int
    layout: Optional[Layout]
    candidate: Optional[Candidate]
    reason: Optional[str]  # why it is not among the admissible candidates
    max_memory_fraction: Optional[float] = None
    rank: Optional[int] = None
    note: Optional[str] = None  # how the user's config was adapted to keep the plan's batch


@dataclass
class Plan:
    gpus: Tuple[int, ...]
    global_batch: int
    global_batch_source: str
    train_iters: Optional[int]
    memory_limit: float  # share of the usable capacity a layout may use (--memory-headroom)
    candidates: List[Candidate]  # admissible, best first
    baselines: List[Baseline]
    evaluated: int
    predicted: int
    admissible: int
    bounded: int
    duplicates: int  # layouts whose partition method cuts the stages of one already counted
    rejected: Dict[str, int]
    no_layout: Dict[int, str]  # GPU count -> one line naming what excluded every layout
    seconds: float
    warnings: List[str] = field(default_factory=list)
    collapsed: int = 0  # timed layouts folded into an equivalent row
    within_interval: int = 0  # of the rows shown after the best, those inside its 80% interval


@dataclass
class _Rejection:
    code: str
    detail: str = ""
    memory_fraction: Optional[float] = None


# ---------------------------------------------------------------------------------------------
# Derivation shared between candidates


class SharedDerive:
    """derive() with the layout-independent part computed once per (mp, stages, method).

    Returns a DerivedModel equal to `derive(cfg, raw_vocab, gpu_memory_bytes)` (a test checks it
    on every candidate of a plan), by calling derive's own building blocks in derive's order.
    """

    def __init__(self, raw_vocab: int, gpu_memory_bytes: Optional[int]):
        self.raw_vocab = raw_vocab
        self.gpu_memory_bytes = gpu_memory_bytes
        self._structure: Dict[tuple, tuple] = {}
        self._recomputed: Dict[tuple, frozenset] = {}
        self._flops: Dict[tuple, object] = {}
        self.builds = 0  # structures computed (for tests: sharing really happens)

    def structure(self, model, mp: int, num_stages: int, method: str, opts):
        """(padded vocab, layers, parts, per-stage parameter counts, totals, largest layer)."""
        from .derive.layers import build_layers
        from .derive.params import param_totals, stage_params
        from .derive.partition import partition
        from .derive.vocab import padded_vocab_size
        mp = max(mp, 1)
        key = (model, mp, num_stages, method, opts)
        hit = self._structure.get(key)
        if hit is None:
            self.builds += 1
            vocab = padded_vocab_size(self.raw_vocab, model.make_vocab_size_divisible_by, mp)
            layers = build_layers(model, mp, vocab, opts)
            parts = tuple(partition(layers, num_stages, method))
            counts = stage_params(layers, parts, mp)
            totals = param_totals(layers, counts, mp)
            largest = max(l.params for l in layers)
            hit = (vocab, layers, parts, counts, totals, largest)
            self._structure[key] = hit
        return hit

    def __call__(self, cfg, stop_above: Optional[float] = None, memories: Optional[dict] = None):
        """derive(cfg); with `stop_above` (bytes), None as soon as one stage needs more (the
        first and last stages, the usual peaks, are computed first). `memories` (stage ->
        StageMemory) holds the stages of cfg computed so far and is filled in: a later call for
        the same cfg starts from where a stopped one left off."""
        from .derive import DeriveOptions
        from .derive.flops import flops
        from .derive.layers import recomputed_layers
        from .derive.memory import stage_memory
        from .derive.model import Stage, assemble
        model, parallel, training = cfg.model, cfg.parallel, cfg.training
        opts = DeriveOptions.from_values(cfg.values)
        vocab, layers, parts, counts, totals, largest = self.structure(
            model, parallel.model_parallel_size, parallel.num_stages,
            parallel.pipe_partition_method, opts)
        num_stages = parallel.num_stages
        pipelined = parallel.pipe_parallel_size >= 1
        order = [0] + list(range(num_stages - 1, 0, -1))
        memories = {} if memories is None else memories
        for s in order:
            mem = memories.get(s)
            if mem is None:
                mem = memories[s] = stage_memory(
                    stage=s, num_stages=num_stages, layers=layers[parts[s]:parts[s + 1]],
                    model=model, parallel=parallel, training=training, padded_vocab=vocab,
                    stage_params=counts[s].per_rank, largest_layer_params=largest,
                    gpu_memory_bytes=self.gpu_memory_bytes, opts=opts)
            if stop_above is not None and mem.device_total > stop_above:
                return None
        stages = []
        for s in range(num_stages):
            chunk = layers[parts[s]:parts[s + 1]]
            stages.append(Stage(
                index=s, start=parts[s], stop=parts[s + 1],
                layer_names=tuple(l.name for l in chunk),
                transformer_layers=sum(1 for l in chunk if l.is_block),
                params_per_rank=counts[s].per_rank, unique_params=counts[s].unique,
                tied_copy_params=counts[s].tied_copy, memory=memories[s]))
        interval = training.checkpoint_num_layers if training.checkpoint_activations else 0
        rkey = (id(layers), parts, interval, pipelined)
        recomputed = self._recomputed.get(rkey)
        if recomputed is None:
            recomputed = self._recomputed[rkey] = recomputed_layers(layers, parts, interval, pipelined)
        # flops() reads these training fields only; the equality test holds it to derive().
        fkey = (rkey, vocab, opts, training.train_batch_size, training.checkpoint_activations,
                training.train_iters)
        estimate = self._flops.get(fkey)
        if estimate is None:
            estimate = self._flops[fkey] = flops(model, training, layers, vocab, recomputed, opts)
        return assemble(cfg, opts, vocab, layers, parts, stages, totals, estimate, pipelined)


# ---------------------------------------------------------------------------------------------
# The planner


def divisors(n: int) -> List[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _values(raw: RawConfig):
    """NeoX's effective raw value of a key: the merged config's, else NeoX's default."""
    def get(key):
        value = raw.values.get(key)
        return KEYS[key][1] if value is None else value
    return get


class Planner:
    def __init__(self, raw: RawConfig, profile: Profile, raw_vocab: int, *, memory_limit: float = 0.9,
                 gpus_per_node: Optional[int] = None, global_batch: Optional[int] = None,
                 max_micro_batch: Optional[int] = None, keep: int = 10,
                 near: Optional[Layout] = None, spare: bool = False):
        if not 0 < memory_limit <= 1:
            raise UsageError(f"--memory-headroom {memory_limit:g} must be in (0, 1]")
        self.raw = raw
        self.profile = profile
        self.facts = profile.facts
        self.capacity = self.facts.gpu_memory_bytes
        from .derive.device_memory import usable
        # what a layout may use: what CUDA lets a process allocate, against the device total
        # (allocated peak + allocator reserve, CUDA context, NCCL: derive/device_memory.py)
        self.usable = usable(self.capacity)
        self.memory_limit = memory_limit
        from .derive.fit import fail_above
        self.fail_above = fail_above(self.capacity, memory_limit)  # bytes, the one rule's
        self.raw_vocab = raw_vocab
        self.gpus_per_node = gpus_per_node
        self.max_micro_batch = max_micro_batch
        self.keep = keep  # layouts the caller shows; 0: every admissible layout is timed
        # `check`'s quick search around the user's layout `near`: every pipeline depth, tensor
        # parallelism within a node (and the user's own), checkpointing on and off, but only the
        # user's micro-batch, ZeRO stage and partition method -- with `spare`, also the most
        # memory-sparing (micro-batch 1, ZeRO 1); it times only its best estimates and leaves
        # the user's own layout (the plan's baselines) to the caller
        self.near = near
        self.spare = spare
        # (mp, micro, pipeline engine) -> per-layer and end-of-pipe seconds, for the bound
        self._units: Dict[tuple, tuple] = {}
        self._timed: Dict[Layout, Candidate] = {}  # layouts the bound predicted in full
        self._tails: Dict[tuple, tuple] = {}  # _tail_key -> per-stage sync + update seconds
        # the same from one micro-batch (near=), with each stage's replicas' wait per second of work
        self._quick_tails: Dict[tuple, tuple] = {}
        self._engine_terms = profile.manifest.engine is not None
        self.bounded = 0
        self.value = _values(raw)
        self.shared = SharedDerive(raw_vocab, self.capacity)
        self._global_batch = global_batch
        self._verdict_cache: Dict[tuple, Optional[_Rejection]] = {}
        self._parts: Dict[tuple, tuple] = {}  # (mp, stages, method) -> DeepSpeed's cuts

    # -- the user's config --------------------------------------------------------------------

    def build(self, gpus: int, overrides: Optional[dict] = None):
        raw = self.raw
        if overrides:
            values = dict(raw.values)
            values.update(overrides)
            sources = dict(raw.sources)
            sources.update({k: "<plan>" for k in overrides})
            raw = RawConfig(values=values, sources=sources, warnings=[], files=list(raw.files))
        return build(raw, WorldRequest(gpus=gpus, gpus_per_node=self.gpus_per_node),
                     cluster_gpus_per_node=self.facts.gpus_per_node)

    def global_batch(self, gpus: Sequence[int]) -> Tuple[int, str]:
        if self._global_batch:
            return self._global_batch, "--global-batch"
        tbs = self.raw.values.get("train_batch_size")
        if isinstance(tbs, int) and tbs > 0:
            return tbs, f"train_batch_size ({self.raw.sources.get('train_batch_size')})"
        worlds = list(gpus)
        g = self.raw.values.get("global_num_gpus")
        if isinstance(g, int) and g > 0:
            worlds.insert(0, g)
        for world in worlds:
            try:
                cfg, verdicts, _ = self.build(world)
            except ConfigError:
                continue
            if any(v.level == "error" and v.code in ("world_divisible", "batch_triple") for v in verdicts):
                continue
            t, p = cfg.training, cfg.parallel
            return t.train_batch_size, (f"micro {t.micro_batch_size} x accumulation "
                                        f"{t.gradient_accumulation_steps} x dp {p.data_parallel_size} "
                                        f"of the config at {world} GPUs")
        # The config's own layout divides none of the GPU counts: its micro-batch x accumulation
        # at the data parallel degree nearest to what the first count would give.
        micro, gas = self.value("train_micro_batch_size_per_gpu"), self.value("gradient_accumulation_steps")
        pp, mp = max(self.value("pipe_parallel_size") or 0, 1), max(self.value("model_parallel_size") or 0, 1)
        if isinstance(micro, int) and isinstance(gas, int) and micro > 0 and gas > 0:
            dp = max(1, round(worlds[0] / (pp * mp)))
            return micro * gas * dp, (f"micro {micro} x accumulation {gas} x dp {dp}, the config's "
                                      f"pipe {pp} x model {mp} not dividing {worlds[0]} GPUs")
        raise ConfigError("neither train_batch_size nor train_micro_batch_size_per_gpu is set, so "
                          "there is no global batch to keep", file=self.raw.files[0] if self.raw.files
                          else None, key="train_micro_batch_size_per_gpu",
                          fix="set train_micro_batch_size_per_gpu (and gradient_accumulation_steps), "
                              "or pass --global-batch N")

    def overrides(self, layout: Layout) -> Dict[str, object]:
        """Normalised keys -> values that turn the user's merged config into `layout`, leaving
        out every key whose NeoX value (config or default) is already the one wanted."""
        v = self.value
        want = {
            "pipe_parallel_size": layout.pipe_parallel_size,
            "model_parallel_size": layout.model_parallel_size,
            "train_micro_batch_size_per_gpu": layout.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": layout.gradient_accumulation_steps,
            "checkpoint_activations": layout.checkpoint_activations,
            "pipe_partition_method": layout.pipe_partition_method,
        }
        if v("train_batch_size") is not None:
            want["train_batch_size"] = layout.train_batch_size
        zero = v("zero_optimization")
        if (zero or ZERO_DEFAULTS).get("stage") != layout.zero_stage:
            # NeoX replaces a zero_optimization dict wholesale: carry the user's other settings.
            want["zero_optimization"] = dict(zero or ZERO_DEFAULTS, stage=layout.zero_stage)
        out = {}
        for key, value in want.items():
            current = v(key)
            if key == "model_parallel_size":
                current = max(current, 1)  # build() reads mp 0 as 1
            if current != value or type(current) is not type(value):
                out[key] = value
        return out

    # -- the candidate space ------------------------------------------------------------------

    def space(self, gpus: int, batch: int) -> Iterator[Layout]:
        """Every layout of `gpus` GPUs the plan considers, structurally rejected ones included
        (they are counted as rejected, by reason)."""
        m = self.model
        user_method = str(self.value("pipe_partition_method"))
        methods = [user_method] + [x for x in PARTITION_METHODS if x != user_method.lower()]
        max_pp = m.num_layers
        node = self.gpus_per_node or self.facts.gpus_per_node
        for mp in divisors(gpus):
            if mp > m.num_attention_heads:
                break
            if self.near is not None and mp > node and mp != self.near.model_parallel_size:
                continue  # the quick search keeps tensor parallelism within a node
            for pp in [0] + divisors(gpus // mp):
                if pp > max_pp:
                    break
                dp = gpus // (max(pp, 1) * mp)
                per_rank = max(1, round(batch / dp)) if batch % dp else batch // dp
                micros = [x for x in divisors(per_rank)
                          if not self.max_micro_batch or x <= self.max_micro_batch]
                # DeepSpeed/NeoX allow ZeRO 2 only without pipeline and tensor parallelism
                zeros = [0, 1] + ([2] if pp == 0 and mp == 1 else [])
                checkpointing = (True, False)
                if self.near is not None and micros:
                    n = self.near
                    sparing = (1,) if self.spare else ()
                    # the user's micro-batch, or the largest below it that divides this split's
                    own = max([x for x in micros if x <= n.train_micro_batch_size_per_gpu] or micros[:1])
                    micros = sorted({own, *(x for x in sparing if x in micros)})
                    zeros = [z for z in zeros if z in (n.zero_stage,) + sparing]
                    methods = [user_method]
                for method in (methods if pp >= 2 else [user_method]):
                    for micro in micros:
                        for ckpt in checkpointing:
                            for zero in zeros:
                                yield Layout(gpus, pp, mp, dp, micro, per_rank // micro, ckpt,
                                             zero, method)

    # -- one candidate ------------------------------------------------------------------------

    def _structural(self, layout: Layout) -> Optional[_Rejection]:
        """What rejects a layout whatever its batch, checkpointing or ZeRO stage (cached per
        model parallel, stages and partition method)."""
        key = (layout.model_parallel_size, layout.num_stages, layout.pipe_partition_method.lower())
        if key in self._verdict_cache:
            return self._verdict_cache[key]
        from .derive import DeriveError, PartitionError
        m, mp = self.model, layout.model_parallel_size
        rej = None
        if m.num_attention_heads % mp:
            rej = _Rejection("heads_divisible_by_mp")
        elif m.num_kv_heads % mp:
            rej = _Rejection("kv_heads_divisible_by_mp")
        elif any(w % mp for w in self.mlp_widths):
            # NeoX's ColumnParallelLinear / RowParallelLinear divide their width by mp (mpu.divide)
            rej = _Rejection("mlp_divisible_by_mp")
        else:
            try:
                _, layers, parts, *_ = self.shared.structure(
                    self.model, mp, layout.num_stages, layout.pipe_partition_method, self.options)
            except PartitionError as exc:
                rej = _Rejection("partition", str(exc))
            except DeriveError as exc:
                rej = _Rejection("config", str(exc))
            else:
                self._parts[key] = parts
                if any(not any(l.is_block for l in layers[parts[s]:parts[s + 1]])
                       for s in range(layout.num_stages)):
                    rej = _Rejection("stage_without_layers")
        self._verdict_cache[key] = rej
        return rej

    def refuse(self, cfg, verdicts) -> Optional[_Rejection]:
        """Why NeoX or DeepSpeed would refuse cfg, or None."""
        from . import checks
        errors = [x for x in list(verdicts) + checks.config_verdicts(cfg) if x.level == "error"]
        if errors:
            return _Rejection(errors[0].code if errors[0].code in REASON_ORDER else "config",
                              errors[0].message)
        return None

    def memory(self, derived) -> Optional[_Rejection]:
        from .derive.fit import memory_fit
        fit = memory_fit([s.memory for s in derived.stages], self.capacity, self.memory_limit)
        if not fit.fits:
            return _Rejection("out_of_memory", memory_fraction=fit.device_total / fit.usable)
        return None

    def judge(self, cfg, verdicts) -> Tuple[Optional[object], Optional[_Rejection]]:
        """(derived model or None, why NeoX/DeepSpeed refuse cfg or it does not fit, or None):
        the same judgement as the plan's loop, for one config."""
        from .derive import DeriveError, PartitionError
        rej = self.refuse(cfg, verdicts)
        if rej is not None:
            return None, rej
        try:
            derived = self.shared(cfg)
        except PartitionError as exc:
            return None, _Rejection("partition", str(exc))
        except DeriveError as exc:
            return None, _Rejection("config", str(exc))
        if any(s.transformer_layers == 0 for s in derived.stages):
            return derived, _Rejection("stage_without_layers")
        return derived, self.memory(derived)

    def evaluate(self, cfg, derived, batch: int) -> Candidate:
        return self._evaluate(cfg, derived, batch)[0]

    def _evaluate(self, cfg, derived, batch: int):
        from .prediction.operators import tensor_parallel_placement
        from .prediction.predict import predict
        from .result import mfu_peak
        pred = predict(cfg, derived, self.profile, timeline_events=False)  # a row reads no event
        est = pred.estimate
        self._tails[_tail_key(cfg)] = tuple(t.grad_allreduce + t.optimizer + t.param_allgather
                                            for t in est.stages)
        it = est.iteration_seconds
        t, p, m = cfg.training, cfg.parallel, cfg.model
        per_batch = it * batch / t.train_batch_size
        iters = t.train_iters
        run = per_batch * iters if iters else None
        peak = mfu_peak(self.profile, self.facts, pred.decomposition)
        flops = derived.flops.model_per_iteration
        mfu = flops / it / p.world_size / 1e12 / peak if peak and flops else None
        worst = max(s.memory.device_total for s in derived.stages)
        return Candidate(
            layout=layout_of(cfg), iteration_seconds=it,
            interval_seconds=tuple(est.interval_seconds) if est.interval_seconds else None,
            tokens_per_second=t.train_batch_size * m.seq_length / it, mfu=mfu,
            max_memory_fraction=worst / self.usable, fits=worst <= self.fail_above,
            dominant=dominant(est), seconds_per_batch=per_batch, run_seconds=run,
            gpu_hours=None if run is None else run * p.world_size / 3600.0,
            batch_difference=t.train_batch_size - batch, breakdown=dict(est.breakdown),
            tp_across_nodes=tensor_parallel_placement(p.model_parallel_size, p.gpus_per_node)[0] > 1), est

    # -- the whole plan -----------------------------------------------------------------------

    def run(self, gpus: Sequence[int]) -> Plan:
        # Thousands of configs, derived models and decompositions stay alive until the ranking;
        # none holds a reference cycle, so the cyclic collector would only rescan them.
        import gc
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(gpus)
        finally:
            if enabled:
                gc.enable()

    def _run(self, gpus: Sequence[int]) -> Plan:
        start = time.perf_counter()
        gpus = tuple(dict.fromkeys(gpus))
        self._prepare(gpus)
        batch, batch_source = self.global_batch(gpus)
        rejected: Dict[str, int] = {}
        per_gpus_rejected: Dict[int, Dict[str, _Rejection]] = {}
        per_gpus_counts: Dict[int, Dict[str, int]] = {}
        admitted: List[tuple] = []  # (bound, cfg, derived)
        evaluated = duplicates = 0
        admitted_worlds: set = set()
        pending: Dict[int, list] = {}  # GPU count -> layouts stopped early by memory, none admitted yet
        for world in gpus:
            counts = per_gpus_counts.setdefault(world, {})
            examples = per_gpus_rejected.setdefault(world, {})
            seen_parts: Dict[tuple, str] = {}
            for layout in self.space(world, batch):
                evaluated += 1
                rej = self._structural(layout)
                cfg = None
                if rej is None:
                    try:
                        cfg, verdicts, _ = self.build(world, self.overrides(layout))
                    except ConfigError as exc:
                        cfg, rej = None, _Rejection("config", exc.line())
                    else:
                        rej = self.refuse(cfg, verdicts)
                if rej is None and layout.num_stages > 1:
                    # Two partition methods that cut the same stages are one layout.
                    parts = self._parts[(layout.model_parallel_size, layout.num_stages,
                                         layout.pipe_partition_method.lower())]
                    same = (layout.model_parallel_size, layout.pipe_parallel_size,
                            layout.train_micro_batch_size_per_gpu, layout.checkpoint_activations,
                            layout.zero_stage, parts)
                    first = seen_parts.setdefault(same, layout.pipe_partition_method)
                    if first != layout.pipe_partition_method:
                        duplicates += 1
                        continue
                if rej is None:
                    memories: dict = {}
                    # stopped at the one rule's FAIL edge (derive.fit.fail_above): a layout
                    # derived whole has every stage at or below it, so it fits
                    derived = self.shared(cfg, stop_above=self.fail_above,
                                          memories=memories)
                    if derived is None:
                        rej = _Rejection("out_of_memory")
                        if world not in admitted_worlds:  # for the "no layout" line, if it comes
                            pending.setdefault(world, []).append((cfg, memories))
                if rej is not None:
                    counts[rej.code] = counts.get(rej.code, 0) + 1
                    if rej.code not in examples:  # the first of each kind, for a "no layout" line
                        examples[rej.code] = _Rejection(rej.code, rej.detail or _describe(layout))
                    continue
                if layout_of(cfg) != layout:  # the overrides must build exactly this layout
                    raise AssertionError(f"planned {layout} but NeoX builds {layout_of(cfg)}")
                admitted.append((self.bound(cfg, derived, batch), cfg, derived))
                admitted_worlds.add(world)
                pending.pop(world, None)
            for code, n in counts.items():
                rejected[code] = rejected.get(code, 0) + n
        # the quick search's caller (check) has judged and predicted the user's layout itself
        baselines = [] if self.near is not None else [self.baseline(w, batch) for w in gpus]
        candidates = self.predict_admitted(admitted, batch, baselines)
        timed = len(candidates)
        rank(candidates)
        candidates = collapse(candidates)
        rank(candidates)
        for b in baselines:
            self.rank_baseline(b, candidates)
        for world, stopped in pending.items():
            # Nothing fits on these GPUs: name the layout that comes closest.
            fraction, cfg = self.closest(stopped)
            per_gpus_rejected[world]["out_of_memory"] = _Rejection(
                "out_of_memory", _describe(layout_of(cfg)), fraction)
        no_layout = {w: self.no_layout_line(w, per_gpus_counts[w], per_gpus_rejected[w])
                     for w in gpus if w not in admitted_worlds}
        return Plan(gpus=gpus, global_batch=batch, global_batch_source=batch_source,
                    train_iters=self.value("train_iters"), memory_limit=self.memory_limit,
                    candidates=candidates, baselines=baselines, evaluated=evaluated,
                    predicted=timed, admissible=len(admitted), bounded=self.bounded,
                    collapsed=timed - len(candidates),
                    within_interval=within_best_interval(candidates, self.keep or len(candidates)),
                    duplicates=duplicates,
                    rejected=dict(sorted(rejected.items(), key=lambda kv: -kv[1])),
                    no_layout=no_layout, seconds=time.perf_counter() - start)

    def closest(self, stopped: List[tuple]) -> Tuple[float, object]:
        """(fraction of the usable memory, config) of the layout whose largest stage needs the
        least -- the first such, in the order given -- among `stopped`: (config, the stages the
        plan's loop computed before it stopped), none of which fits.

        Branch and bound, equal to the minimum over every layout fully derived (a test holds it
        so): a computed stage is a lower bound of its layout's largest, so layouts are taken
        by that bound, a layout stops at its first stage above the best so far, and the search
        ends when the next bound is above it. Out-of-memory plans of large models hold ~100
        such layouts of up to 64 stages: deriving each in full was most of `check`'s time."""
        order = sorted(range(len(stopped)),
                       key=lambda i: max(m.device_total for m in stopped[i][1].values()))
        best = None  # (total bytes, position in stopped)
        for i in order:
            cfg, memories = stopped[i]
            if best is not None and max(m.device_total for m in memories.values()) > best[0]:
                break
            derived = self.shared(cfg, stop_above=None if best is None else best[0],
                                  memories=memories)
            if derived is None:
                continue
            total = max(s.memory.device_total for s in derived.stages)
            if best is None or total < best[0] or (total == best[0] and i < best[1]):
                best = (total, i)
        return best[0] / self.usable, stopped[best[1]][0]

    def _prepare(self, gpus: Sequence[int]) -> None:
        """The model (layout-independent) from the user's config; stop on a layout-independent
        error the way `check` does."""
        from . import checks
        from .derive.params import mlp_widths
        probe = {"pipe_parallel_size": 1, "model_parallel_size": 1,
                 "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "train_batch_size": None}
        cfg, verdicts, _ = self.build(1, probe)
        for verdict in list(verdicts) + checks.config_verdicts(cfg):
            if verdict.level == "error" and verdict.code not in LAYOUT_CODES:
                raise ConfigError(verdict.message, file=self.raw.sources.get(verdict.key or ""),
                                  key=verdict.key, fix=verdict.fix)
        # a run this GPU cannot compute in any layout (bf16 on a V100) is said in one line, as
        # `check` says it, not found out as "no layout fits" (the planner prices none that does not)
        from .predictors import achievable
        achievable.limits(self.profile, cfg.training.precision)
        self.model = cfg.model
        self.mlp_widths = mlp_widths(cfg.model)
        from .derive import DeriveOptions
        self.options = DeriveOptions.from_values(self.raw.values)  # what the layer list reads

    def baseline(self, world: int, batch: int) -> Baseline:
        """The user's own config at `world` GPUs, built as `check` builds it -- except that where
        NeoX derives the global batch from micro x accumulation x dp (no train_batch_size), the
        accumulation is set to keep the plan's batch, as the user would at another GPU count."""
        note = None
        try:
            cfg, verdicts, _ = self.build(world)
            t, p = cfg.training, cfg.parallel
            if t.train_batch_size != batch and self.value("train_batch_size") is None:
                gas = max(1, round(batch / (t.micro_batch_size * p.data_parallel_size)))
                if gas != t.gradient_accumulation_steps:
                    kept = gas * t.micro_batch_size * p.data_parallel_size
                    note = (f"accumulation {gas} instead of {t.gradient_accumulation_steps} "
                            + (f"keeps the global batch {batch}" if kept == batch else
                               f"comes nearest the global batch {batch} ({kept})"))
                    cfg, verdicts, _ = self.build(world, {"gradient_accumulation_steps": gas})
        except ConfigError as exc:
            return Baseline(world, None, None, exc.line())
        layout = layout_of(cfg)
        derived, rej = self.judge(cfg, verdicts)
        if rej is not None and rej.code != "out_of_memory":
            return Baseline(world, layout, None, rej.detail or REASONS[rej.code][0], note=note)
        cand = self.evaluate(cfg, derived, batch)
        if rej is not None:
            return Baseline(world, layout, cand,
                            f"needs {cand.max_memory_fraction:.0%} of GPU memory, above the "
                            f"{self.memory_limit:.0%} memory limit", cand.max_memory_fraction, note=note)
        return Baseline(world, layout, cand, None, cand.max_memory_fraction, note=note)

    @staticmethod
    def rank_baseline(b: Baseline, candidates: List[Candidate]) -> None:
        """Its rank among the admissible layouts (or where it would rank, when the plan's space
        does not hold it, e.g. a micro-batch that changes the global batch)."""
        if b.candidate is None or b.reason is not None:
            return
        same = next((c for c in candidates if c.layout == b.layout or b.layout in c.equivalent),
                    None)
        if same is not None:
            b.candidate, b.rank = same, same.rank
        else:
            b.rank = 1 + sum(1 for c in candidates
                             if c.seconds_per_batch < b.candidate.seconds_per_batch)

    def bound(self, cfg, derived, batch: int, tails: Optional[Sequence[float]] = None) -> float:
        """A lower bound of the candidate's seconds per plan batch, from its stage times alone:
        stage s cannot finish before the first micro-batch has crossed stages < s, its own m
        forwards and backwards have run, and the last backward has crossed back to stage 0.
        The per-stage times come from one full prediction per (model parallel, micro-batch,
        pipeline engine) -- one transformer layer, the embedding and the head cost the same in
        every layout sharing those -- so the bound needs no decomposition and no 1F1B timeline.
        0 (every layout timed) when the profile's engine terms depend on more than the shapes.
        `tails`: per stage, seconds of gradient sync + update a full prediction of a layout with
        the same stages, data parallel and ZeRO found (micro-batch and checkpointing leave them
        unchanged); each stage also cannot finish before its own ready time plus that."""
        if self._engine_terms and self.near is None:
            return 0.0
        shares = None  # per stage, the replicas' wait per second of its work (quick search)
        stages = derived.stages
        last = len(stages) - 1
        key = (cfg.parallel.model_parallel_size, cfg.training.micro_batch_size,
               cfg.parallel.pipe_parallel_size >= 1)
        unit = self._units.get(key)
        one = None
        missing = unit is None or any((s.index == 0, s.index == last) not in unit[2] for s in stages)
        if self.near is not None and tails is None:
            # The quick search ranks by this estimate (a bound only without engine terms) and
            # times few layouts, so it needs every layout's gradient sync and update: they come
            # from a prediction of one micro-batch (the 1F1B timeline costs micro-batches x
            # stages; per-micro-batch stage times, the sync and the update do not depend on them),
            # of the sync and the update alone where the stage times are known already.
            tkey = _tail_key(cfg)
            quick = self._quick_tails.get(tkey)
            if quick is None:
                if missing:
                    one = self._one_micro_batch(cfg, derived)
                    parts = [(t.grad_allreduce, t.optimizer, t.param_allgather,
                              t.dp_wait / (t.forward + t.backward) if t.dp_wait > 0 else 0.0)
                             for t in one.stages]
                else:
                    parts = self._one_micro_batch_update(cfg, derived)
                per = cfg.training.gradient_accumulation_steps if cfg.training.zero_stage >= 2 else 1
                quick = self._quick_tails[tkey] = (tuple(g * per + o + a for g, o, a, _ in parts),
                                                   tuple(w for *_, w in parts))
            tails, shares = quick
        if missing:
            if self.near is not None:
                cand, est = None, one or self._one_micro_batch(cfg, derived)
            else:
                cand, est = self._evaluate(cfg, derived, batch)
                self._timed[cand.layout] = cand
            first = next((t for s, t in zip(stages, est.stages) if s.transformer_layers), est.stages[0])
            lf, lb = first.layer_forward, first.layer_backward
            extras = dict(unit[2]) if unit else {}
            for s, t in zip(stages, est.stages):
                n = s.transformer_layers
                extras[(s.index == 0, s.index == last)] = (t.forward - n * lf,
                                                           t.backward - n * lb - t.recompute)
            self._units[key] = unit = (lf, lb, extras)
            if cand is not None:
                return cand.seconds_per_batch
        lf, lb, extras = unit
        m = cfg.training.gradient_accumulation_steps
        ckpt = cfg.training.checkpoint_activations
        fsum = bsum = best = 0.0
        for st in stages:
            n = st.transformer_layers
            ef, eb = extras[(st.index == 0, st.index == last)]
            f = n * lf + ef
            b = n * lb + (n * lf if ckpt else 0.0) + eb
            own = fsum + m * (f + b)
            if own + bsum > best:
                best = own + bsum
            if tails is not None:
                # the replicas wait for the slowest before the gradient sync (dp_arrival)
                tail = tails[st.index] + (shares[st.index] * m * (f + b) if shares else 0.0)
                if own + tail > best:
                    best = own + tail
            fsum += f
            bsum += b
        # The timeline adds the same terms in another order: allow for rounding.
        return best * (1 - 1e-9) * batch / cfg.training.train_batch_size

    @staticmethod
    def _one(cfg):
        """`cfg` run with one micro-batch per iteration (same stages, shapes)."""
        from dataclasses import replace
        t = cfg.training
        return replace(cfg, training=replace(t, gradient_accumulation_steps=1,
                                             train_batch_size=t.micro_batch_size
                                             * cfg.parallel.data_parallel_size))

    def _one_micro_batch(self, cfg, derived):
        """The estimate of `cfg` run with one micro-batch per iteration."""
        from .prediction.predict import predict
        return predict(self._one(cfg), derived, self.profile, timeline_events=False,
                       price_other=False).estimate  # its stages' times, no interval

    def _one_micro_batch_update(self, cfg, derived):
        """Per stage (gradient sync, optimizer step, parameter all-gather) of that estimate."""
        from .prediction.predict import update_seconds
        return update_seconds(self._one(cfg), derived, self.profile)

    def predict_admitted(self, admitted: List[tuple], batch: int,
                         baselines: List[Baseline]) -> List[Candidate]:
        """Time the admitted layouts in order of their bound, skipping those that can neither
        reach the top `keep`, nor beat a user layout, nor join the time/GPU-hours Pareto front."""
        import bisect
        admitted.sort(key=lambda a: a[0])
        known = {b.layout: b.candidate for b in baselines if b.candidate is not None and b.reason is None}
        beat = max((c.seconds_per_batch for c in known.values()), default=0.0)
        done: List[Candidate] = []
        times: List[float] = []
        self.bounded = 0
        for bound, cfg, derived in admitted:
            if self.near is not None and len(times) >= max(self.keep, 1):
                self.bounded += 1  # the quick search times only its best estimates
                continue
            if self.keep and len(times) >= self.keep:
                limit = max(times[self.keep - 1], beat)
                tails = self._tails.get(_tail_key(cfg))
                if bound < limit and tails is not None:
                    bound = self.bound(cfg, derived, batch, tails)
                gpus = cfg.parallel.world_size
                if bound >= limit and any(c.seconds_per_batch <= bound and
                                          c.seconds_per_batch * c.layout.gpus <= bound * gpus
                                          for c in done):
                    self.bounded += 1
                    continue
            layout = layout_of(cfg)
            cand = known.get(layout) or self._timed.get(layout) or self.evaluate(cfg, derived, batch)
            bisect.insort(times, cand.seconds_per_batch)
            done.append(cand)
        return done

    def no_layout_line(self, world: int, counts: Dict[str, int],
                       examples: Dict[str, _Rejection]) -> str:
        m = self.model
        parts = []
        for code in sorted(counts, key=lambda c: REASON_ORDER.index(c) if c in REASON_ORDER else 99):
            n = counts[code]
            if code == "heads_divisible_by_mp":
                parts.append(f"heads {m.num_attention_heads} divide by mp "
                             f"{_list(divisors(m.num_attention_heads))} only")
            elif code == "kv_heads_divisible_by_mp":
                parts.append(f"kv heads {m.num_kv_heads} divide by mp {_list(divisors(m.num_kv_heads))} only")
            elif code == "mlp_divisible_by_mp":
                g = math.gcd(*self.mlp_widths)
                parts.append(f"MLP widths {'/'.join(map(str, self.mlp_widths))} divide by mp "
                             f"{_list([d for d in divisors(g) if d <= m.num_attention_heads])} only")
            elif code == "out_of_memory":
                ex = examples[code]
                parts.append(f"{n} layouts need more than {self.memory_limit:.0%} of the "
                             f"{self.usable / 2**30:.1f} GiB usable (least: {ex.memory_fraction:.0%} at "
                             f"{ex.detail})")
            else:
                parts.append(f"{n} layouts: {REASONS.get(code, (code,))[0]}"
                             + (f" (e.g. {examples[code].detail})" if examples[code].detail else ""))
        if not parts:
            parts.append(f"no split of {world} GPUs into pipe x model x data parallel has "
                         f"pipe <= {m.num_layers} layers and model parallel <= "
                         f"{m.num_attention_heads} heads")
        return f"--gpus {world} admits no layout: " + "; ".join(parts)


REASONS = {
    "heads_divisible_by_mp": ("model parallel does not divide the attention heads",),
    "kv_heads_divisible_by_mp": ("model parallel does not divide the KV heads",),
    "mlp_divisible_by_mp": ("model parallel does not divide the MLP width",),
    "stage_without_layers": ("a pipeline stage would hold no transformer layer",),
    "partition": ("DeepSpeed cannot partition the layers",),
    "zero_with_model_parallel": ("ZeRO 2/3 with pipeline or model parallelism",),
    "moe_zero": ("MoE with ZeRO 2/3",),
    "config": ("NeoX refuses the config",),
    "out_of_memory": ("does not fit GPU memory within the memory limit",),
}


def _tail_key(cfg) -> tuple:
    """What a stage's gradient sync, optimizer step and parameter all-gather depend on: its
    parameters (model parallel, stages, partition), the data-parallel group, the ZeRO stage and,
    for ZeRO 2 (which reduces in every micro-batch), the accumulation steps."""
    p, t = cfg.parallel, cfg.training
    return (p.model_parallel_size, p.pipe_parallel_size, p.pipe_partition_method.lower(),
            p.data_parallel_size, t.zero_stage,
            t.gradient_accumulation_steps if t.zero_stage >= 2 else None)


def _list(xs: Sequence[int]) -> str:
    return ", ".join(map(str, xs))


def _describe(l: Layout) -> str:
    method = f", partition {l.pipe_partition_method}" if l.num_stages > 1 else ""
    return (f"pp {l.pipe_parallel_size}, mp {l.model_parallel_size}, dp {l.data_parallel_size}, "
            f"micro {l.train_micro_batch_size_per_gpu} x {l.gradient_accumulation_steps}, "
            f"checkpointing {'on' if l.checkpoint_activations else 'off'}, ZeRO {l.zero_stage}"
            f"{method}")


def dominant(est) -> str:
    """The largest share of the critical path, in one word."""
    c = est.timeline.components
    b = est.breakdown
    tp = b.get("mp_allreduce", 0.0)
    # the pipeline's all-gathers of its partitioned tensors run inside forward / backward, but
    # are the price of the stage-to-stage transfer, as the sends are
    gather = b.get("pp_allgather", 0.0)
    parts = {
        "compute": max(c.get("critical_compute_seconds", 0.0) - tp - gather, 0.0),
        "TP-comm": tp,
        "bubble": c.get("bubble_seconds", 0.0),
        "p2p": c.get("pp_p2p_seconds", 0.0) + gather,
        "DP-sync": (c.get("dp_allreduce_exposed", 0.0) + c.get("tied_allreduce_exposed", 0.0)
                    + max(c.get("update_seconds", 0.0) - b.get("optimizer", 0.0), 0.0)),
        "optimizer": b.get("optimizer", 0.0),
    }
    return max(parts, key=parts.get)


def rank(candidates: List[Candidate]) -> None:
    """Best first by time to train the plan's batch; ranks 1..n; the Pareto front of time against
    GPU-hours (with one GPU count that is the fastest layout)."""
    candidates.sort(key=lambda c: (c.seconds_per_batch, c.layout.gpus, _order(c.layout)))
    for i, c in enumerate(candidates, 1):
        c.rank = i
    best_cost = math.inf
    for c in candidates:  # time ascending: on the front iff cheaper than everything faster
        if c.cost < best_cost:
            c.pareto = True
            best_cost = c.cost


def collapse(candidates: List[Candidate]) -> List[Candidate]:
    """The ranked candidates with layouts that differ only in a setting that changes nothing
    predicted -- partition method or ZeRO stage, at the same time (within 0.1%) and memory
    (within half a percent of the GPU) -- folded into the best of them (its `equivalent`)."""
    kept: List[Candidate] = []
    groups: Dict[tuple, List[Candidate]] = {}
    for c in candidates:
        l = c.layout
        key = (l.gpus, l.pipe_parallel_size, l.model_parallel_size,
               l.train_micro_batch_size_per_gpu, l.gradient_accumulation_steps,
               l.checkpoint_activations)
        same = next((k for k in groups.get(key, ())
                     if abs(k.seconds_per_batch - c.seconds_per_batch) <= 1e-3 * k.seconds_per_batch
                     and abs(k.max_memory_fraction - c.max_memory_fraction) <= 0.005), None)
        if same is None:
            groups.setdefault(key, []).append(c)
            kept.append(c)
        else:
            same.equivalent.append(l)
    return kept


def within_best_interval(candidates: Sequence[Candidate], shown: int) -> int:
    """How many of the rows after the best (among the `shown` first) the best's 80% interval
    holds: the profile's error could reorder those."""
    if not candidates or not candidates[0].interval_seconds:
        return 0
    best = candidates[0]
    high = best.interval_seconds[1] * best.seconds_per_batch / best.iteration_seconds
    return sum(1 for c in candidates[1:shown] if c.seconds_per_batch <= high)


def _order(l: Layout) -> tuple:
    return (l.pipe_parallel_size, l.model_parallel_size, l.train_micro_batch_size_per_gpu,
            not l.checkpoint_activations, l.zero_stage, l.pipe_partition_method)
