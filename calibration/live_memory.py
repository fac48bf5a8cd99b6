"""Live tensor bytes of one rank over one training iteration: the peak, and what was live at it.

What "memory" means here is what a GPU's caching allocator hands out (what
`torch.cuda.max_memory_allocated` reports), measured the same way on a CPU: the bytes of every
tensor storage alive at each moment, not the process's resident set. The accounting is torch's
own dispatch-mode tracker, `torch.distributed._tools.mem_tracker.MemTracker` (torch >= 2.5):
every operator's outputs are seen as they are made, and each storage is dropped from the
count when it is freed (a weak reference on the storage). Its allocation rounding is the CUDA
caching allocator's 512 bytes on a GPU, exact bytes on a CPU.

What MemTracker does not fit, this subclass replaces (as torch's own FSDPMemTracker does):
- its categories: ours are those `check` predicts (COMPONENTS below). A tensor is sorted by
  where it is made -- in a forward pass (activations), in a checkpointed chunk's re-run forward
  inside backward (recompute), in a pipeline send/receive or gradient reduction (buffers), in
  backward or the optimizer step (temporaries) -- except that anything whose last dimension is
  the stage's vocabulary slice is logits (the head's output, the loss's fp32 copy, their
  gradients), and the training state is named from the engine: parameters (weights), their
  .grad and DeepSpeed's gradient buffers (gradients), the optimizer's own parameters when they
  are not the module's (master weights), the optimizer's state (optimizer states);
- its module tracker, which refuses a root module called twice in one iteration (every
  micro-batch calls it).
Tensors already alive when the window opens are found by walking the garbage collector's
objects once, so the count starts from everything Python can reach (the training state, the
pipeline's receive buffers, cached masks), not from zero.

Every call is a Python dispatch per operator, which slows the measured iteration several-fold:
the tracker runs for one iteration (the hook marks it perturbed, like a profiling window) and
never raises into training -- any error turns it off and is reported in its result.
"""
from __future__ import annotations

import gc
import os
import time
from typing import Any, Dict, List, Optional

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _RefType, _UpdateType
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from neox_perf.derive.memory import COMPONENTS

from .engine_state import base_optimizer, module_of

TRACE_ENV = "NEOX_PERF_MEMORY_TRACE"
LARGEST = 40  # groups of tensors listed in the result
SOURCE = "live tensor bytes (torch.distributed._tools.mem_tracker.MemTracker, dispatch mode)"


class Component(_RefType):
    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    MASTER = "master_weights"
    STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    RECOMPUTE = "recompute"
    LOGITS = "logits"
    BUFFERS = "buffers"
    TEMPORARIES = "temporaries"
    OTHER = "other"


assert tuple(c.value for c in Component) == COMPONENTS

# Engine phase names (engine_patch's, validate_worker's PhaseClock's) -> what a tensor made
# inside them is. The innermost named phase decides.
_PHASES = {
    "forward": Component.ACTIVATIONS,
    "backward": Component.TEMPORARIES,
    "step": Component.TEMPORARIES, "optimizer_step": Component.TEMPORARIES,
    "optimizer": Component.TEMPORARIES,
    "reduce_grads": Component.BUFFERS, "reduce_tied_grads": Component.BUFFERS,
    "grad_sync": Component.BUFFERS, "send_activations": Component.BUFFERS,
    "recv_activations": Component.BUFFERS, "send_grads": Component.BUFFERS,
    "recv_grads": Component.BUFFERS, "p2p": Component.BUFFERS,
    "load_micro_batch": Component.OTHER,
}
# phases where the head and the loss run (pp = 0: NeoX computes the loss between the engine's
# forward and backward, outside both), and the matrix products the head is computed with
_LOGITS_PHASES = (None, Component.ACTIVATIONS, Component.TEMPORARIES)
_HEAD_WEIGHTS = ("final_linear.weight", "word_embeddings.weight")  # NeoX's and the workload's
_PRODUCTS = ("mm", "addmm", "matmul", "linear", "bmm", "baddbmm", "_scaled_mm")
# DeepSpeed optimizer-wrapper attributes, by the words in their names (0.19.8: ZeRO's
# averaged_gradients / ipg_buffer / grads_in_partition, BF16_Optimizer's
# fp32_groups_gradients_flat, FP16_Optimizer's fp32_groups_flat, ZeRO's
# single_partition_of_fp32_groups, the bit16 flat buffers the module's parameters view).
_WRAPPER_WORDS = ((("grad", "ipg"), Component.GRADIENTS),
                  (("fp32", "master", "hp_", "single_partition"), Component.MASTER),
                  (("bit16", "fp16", "bf16", "lp_", "flat"), Component.WEIGHTS))
# DeepSpeed 0.19.8 ZeRO-1/2 (stage_1_and_2.py): what the gradient hooks call (the first
# allocates the reduce bucket, setup_buckets), and the
# reduction the PipelineEngine calls after backward
_REDUCTION_METHODS = ("process_gradients", "reduce_ready_partitions_and_remove_grads",
                      "reduce_gradients")
_ENGINE_BUFFERS = ("pipe_recv_buf", "grad_layer", "_grad_layer_buf", "first_output_send",
                   "meta_buffer")


def _storages(t) -> List:
    try:
        if t.is_sparse or t.device.type == "meta":
            return []
        st = t.untyped_storage()
    except Exception:
        return []
    return [st] if st.nbytes() else []


class _Tracker(MemTracker):
    """MemTracker with our components and no module tracker (see the module docstring)."""

    def __init__(self, owner: "LiveMemory"):
        super().__init__()
        self._ref_class = Component
        self.owner = owner
        self.peak_moment: Optional[str] = None
        self.peak_tensors: List = []  # _WeakRefInfo of every storage alive near the peak
        self._made: List = []  # trace only: storages made and freed since the last operator
        self._freed: List = []
        self._listed_at = 0

    # -- classification ----------------------------------------------------------------------
    def mark(self, t, component: Component) -> None:
        for st in _storages(t):
            winfo, _ = self._WINFO.get(st, (None, None))
            if winfo is None:
                self._track(component, t)
                self._describe(t, "alive at start")
            elif winfo.reftype != component:
                old, winfo.reftype = winfo.reftype, component
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

    def _describe(self, t, made_by) -> None:
        for st in _storages(t):
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is not None and not hasattr(winfo, "desc"):
                winfo.desc = (str(made_by), tuple(t.shape), str(t.dtype).replace("torch.", ""),
                              self.owner.moment())
                if self.owner.trace is not None:
                    self._made.append(winfo)

    def _delete_callback(self, winfo, w_st) -> None:
        super()._delete_callback(winfo, w_st)
        if self.owner.trace is not None:
            desc = getattr(winfo, "desc", ("?", (), "", ""))
            self._freed.append([winfo.reftype.value, desc[0], list(desc[1]), winfo.mem_consumed])

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 (no module snapshots)
        snap = self._curr_mem_snap.get(self.owner.device)
        if snap is not None and snap["Total"] > self._peak_mem.get(self.owner.device, 0):
            dev = self.owner.device
            self._peak_mem[dev] = snap["Total"]
            self._peak_mem_snap[dev] = dict(snap)
            self.peak_moment = self.owner.moment()
            # the tensors themselves, listed again only when the peak has grown by 1%
            if snap["Total"] > self._listed_at * 1.01:
                self._listed_at = snap["Total"]
                self.peak_tensors = [w for w, _ in self._WINFO.values() if w.device == dev]

    # -- the mode ----------------------------------------------------------------------------
    def __enter__(self):
        self._track_resize()
        self._peak_mem_snap = {d: dict(s) for d, s in self._curr_mem_snap.items()}
        self._peak_mem = {d: s["Total"] for d, s in self._curr_mem_snap.items()}
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args):
        self._restore_resize()
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        owner = self.owner
        if owner.error is None:
            try:
                component = owner.component_now()
                if owner.head_ranges and component in _LOGITS_PHASES:
                    if self._logits_from(func, args, kwargs):
                        component = Component.LOGITS
                not_logits = owner.head_shapes if component is Component.LOGITS else ()

                def track(t):
                    c = component
                    if not_logits and tuple(t.shape) in not_logits:
                        c = Component.TEMPORARIES  # the head weight's own gradient
                    self._track(c or Component.OTHER, t)
                    self._describe(t, func)
                tree_map_only(torch.Tensor, track, res)
                self._update_peak_stats(None)
                if owner.trace is not None:
                    snap = self._curr_mem_snap.get(owner.device, {})
                    made = [[w.reftype.value, list(w.desc[1]), w.mem_consumed]
                            for w in self._made if getattr(w, "desc", (None,))[0] == str(func)]
                    owner.trace.append((str(func), owner.moment(), made, self._freed,
                                        snap.get("Total", 0)))
                    self._made, self._freed = [], []
            except Exception as exc:  # never into training: stop counting, say why
                owner.error = f"{exc.__class__.__name__}: {exc}"
        return res

    def _logits_from(self, func, args, kwargs) -> bool:
        """True if the op makes logits: in forward, a matrix product with the output head's
        weight; then anything computed from logits, in forward and backward, except the
        head's own backward products (they take the weight: its input's and its weight's
        gradient)."""
        head, logits = False, False
        ranges = self.owner.head_ranges
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                # by address, not storage: under ZeRO every parameter views one flat buffer
                ptr = t.data_ptr()
                if any(lo <= ptr < hi for lo, hi in ranges):
                    head = True
                    continue
                for st in _storages(t):
                    w = self._WINFO.get(st, (None, None))[0]
                    if w is not None and w.reftype is Component.LOGITS:
                        logits = True
        if head:
            return torch._C._current_graph_task_id() == -1 and \
                str(func).split(".")[1] in _PRODUCTS
        return logits


class LiveMemory:
    """One measurement window: `start()` before an iteration, `stop()` after it; `enter` /
    `leave` name the engine phase being run; `result()` is a JSON-ready dict."""

    def __init__(self, engine, vocab_local: Optional[int] = None):
        self.engine = engine
        self.vocab_local = int(vocab_local) if vocab_local else None
        self.device = _engine_device(engine)
        self.error: Optional[str] = None
        self.phases: List[str] = []
        self.recompute_depth = 0
        self.tracker = _Tracker(self)
        self._handles: List[Any] = []
        self._seconds = 0.0
        self._start_snapshot: Dict[str, int] = {}
        self._started = False
        self._cuda: Dict[str, Any] = {}
        self.head_ranges: List[tuple] = []  # the output head weights' addresses [lo, hi)
        self._module_params: List[Any] = []
        self.head_shapes: set = set()
        self._unwrap: List[Any] = []
        # NEOX_PERF_MEMORY_TRACE=DIR: every operator of the window with the live total after it,
        # one JSON line each (for re-deriving what a layer keeps; slow, never on by default)
        self.trace_dir = os.environ.get(TRACE_ENV) or None
        self.trace: Optional[List[tuple]] = [] if self.trace_dir else None

    # -- phases ------------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        self.phases.append(phase)

    def leave(self, phase: str) -> None:
        if phase in self.phases:  # the innermost of that name (a failed phase may skip leave)
            i = len(self.phases) - 1 - self.phases[::-1].index(phase)
            del self.phases[i:]

    def leave_last(self) -> None:
        if self.phases:
            self.phases.pop()

    def component_now(self) -> Optional[Component]:
        if self.recompute_depth > 0:
            return Component.RECOMPUTE
        for phase in reversed(self.phases):
            c = _PHASES.get(phase)
            if c is not None:
                return c
        return None

    def moment(self) -> str:
        return " > ".join(self.phases) + (" > recompute" if self.recompute_depth else "")

    # -- the window --------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.device.type == "cuda":
                self._cuda["run_max_allocated_before"] = int(torch.cuda.max_memory_allocated(self.device))
                self._cuda["run_max_reserved_before"] = int(torch.cuda.max_memory_reserved(self.device))
                torch.cuda.reset_peak_memory_stats(self.device)
                self._cuda["allocated_at_start"] = int(torch.cuda.memory_allocated(self.device))
            self._register_alive()
            self._install_hooks()
            self._start_snapshot = self._snapshot("current")
            self.tracker.__enter__()
            self._started = True
        except Exception as exc:
            self.error = f"starting: {exc.__class__.__name__}: {exc}"
            self._remove_hooks()
        self._seconds += time.perf_counter() - t0

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        t0 = time.perf_counter()
        try:
            self.tracker.__exit__(None, None, None)
        except Exception as exc:
            self.error = self.error or f"stopping: {exc.__class__.__name__}: {exc}"
        self._remove_hooks()
        self._module_params = []  # the window is over: hold nothing of the model
        if self.device.type == "cuda":
            try:
                self._cuda["window_max_allocated"] = int(torch.cuda.max_memory_allocated(self.device))
                self._cuda["window_max_reserved"] = int(torch.cuda.max_memory_reserved(self.device))
            except Exception:
                pass
        self._seconds += time.perf_counter() - t0

    def write_trace(self, rank: int) -> None:
        if self.trace is None:
            return
        import json
        os.makedirs(self.trace_dir, exist_ok=True)
        with open(os.path.join(self.trace_dir, f"memtrace-{rank:05d}.jsonl"), "w") as fh:
            for op, moment, made, freed, total in self.trace:
                fh.write(json.dumps({"op": op, "phase": moment, "made": made, "freed": freed,
                                     "total": total}) + "\n")

    def result(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"source": SOURCE, "device": str(self.device), "error": self.error}
        if self.error is not None:
            return out
        peak = self._snapshot("peak")
        out.update({
            "peak_bytes": peak.pop("total", 0),
            "at_peak": peak,
            "peak_moment": self.tracker.peak_moment,
            "at_start": self._start_snapshot,
            "largest_at_peak": self._largest(),
            "tracker_seconds": self._seconds,
        })
        if self._cuda:
            c = self._cuda
            out["cuda"] = {
                **c, "max_allocated": max(c.get("run_max_allocated_before", 0),
                                          c.get("window_max_allocated", 0)),
                "max_reserved": max(c.get("run_max_reserved_before", 0),
                                    c.get("window_max_reserved", 0))}
        return out

    def _largest(self, n: int = LARGEST) -> List[Dict[str, Any]]:
        """The biggest groups of tensors alive at (within 1% of) the peak, by what made them."""
        groups: Dict[tuple, List[int]] = {}
        for w in self.tracker.peak_tensors:
            desc = getattr(w, "desc", ("alive at start", None, None, ""))
            key = (w.reftype.value,) + tuple(desc)
            g = groups.setdefault(key, [0, 0])
            g[0] += 1
            g[1] += w.mem_consumed
        rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:n]
        return [{"component": k[0], "made_by": k[1], "shape": None if k[2] is None else list(k[2]),
                 "dtype": k[3], "phase": k[4], "count": c, "bytes": b} for k, (c, b) in rows]

    def _snapshot(self, which: str) -> Dict[str, int]:
        snap = (self.tracker._curr_mem_snap if which == "current"
                else self.tracker._peak_mem_snap).get(self.device, {})
        out = {c: int(snap.get(Component(c), 0)) for c in COMPONENTS}
        out["total"] = int(snap.get("Total", 0))
        return out

    # -- what is alive when the window opens -----------------------------------------------
    def _register_alive(self) -> None:
        tr = self.tracker
        # unreachable tensors in reference cycles hold memory only until the next collection:
        # collected now, they cannot make a peak of garbage inside the window
        gc.collect()
        tensor = torch.Tensor
        for obj in gc.get_objects():
            # type(), not isinstance: the latter reads obj.__class__, which some lazy
            # module attributes answer with a deprecation warning
            if issubclass(type(obj), tensor):
                try:
                    if obj.device == self.device:
                        tr.mark(obj, Component.OTHER)
                except Exception:
                    continue
        engine = self.engine
        for name in _ENGINE_BUFFERS:
            for t in _tensors(engine.__dict__.get(name)):
                tr.mark(t, Component.BUFFERS)
        self._register_pipe_slots(engine.__dict__.get("pipe_buffers"))
        wrapper = getattr(engine, "optimizer", None)
        if wrapper is not None and type(wrapper).__module__.startswith("deepspeed"):
            for attr, value in vars(wrapper).items():
                component = _wrapper_component(attr)
                for t in _tensors(value):
                    tr.mark(t, component)
        opt = base_optimizer(engine)
        module = module_of(engine)
        named = list(module.named_parameters())  # parameters() is its values, in its order
        module_params = [p for _, p in named]
        own = {id(p) for p in module_params}
        if opt is not None:
            for group in getattr(opt, "param_groups", []):
                for p in group["params"]:
                    if id(p) not in own:
                        tr.mark(p, Component.MASTER)
                    if p.grad is not None:
                        tr.mark(p.grad, Component.GRADIENTS)
            for state in getattr(opt, "state", {}).values():
                for t in _tensors(state):
                    tr.mark(t, Component.STATES)
        for p in module_params:
            tr.mark(p, Component.WEIGHTS)
            if p.grad is not None:
                tr.mark(p.grad, Component.GRADIENTS)
        if not self.vocab_local:  # no config: the word embedding's rows are V/tp
            self.vocab_local = next((int(p.shape[0]) for n, p in named
                                     if n.endswith("word_embeddings.weight") and p.dim() == 2), None)
        for name, p in named:
            # the output head: NeoX's final_linear (untied) or its word embedding (tied), both
            # [V/tp, h] (a shape alone is ambiguous: with tp > 1, V/tp can equal h)
            if self.vocab_local and name.endswith(_HEAD_WEIGHTS) and p.dim() == 2 \
                    and p.shape[0] == self.vocab_local:
                self.head_ranges.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()))
                self.head_shapes.add(tuple(p.shape))
        self._module_params = module_params

    def _register_pipe_slots(self, slots) -> None:
        """The PipelineEngine's per-micro-batch slots, as made: a received input is a buffer
        (a loaded batch on the first stage: other), labels are data, the last stage's outputs
        are logits, other stages' outputs activations. A received input whose micro-batch's
        graph is still held (by the logits in a slot) keeps its gradient: a backward temporary."""
        if not isinstance(slots, dict):
            return
        engine, tr = self.engine, self.tracker
        first = bool(getattr(engine, "is_first_stage", lambda: True)())
        last = bool(getattr(engine, "is_last_stage", lambda: True)())
        kinds = {"inputs": Component.OTHER if first else Component.BUFFERS,
                 "labels": Component.OTHER,
                 "outputs": Component.LOGITS if last else Component.ACTIVATIONS,
                 "output_tensors": Component.ACTIVATIONS}
        for key, component in kinds.items():
            for t in _tensors(slots.get(key)):
                tr.mark(t, component)
                if key == "inputs" and t.grad is not None:
                    tr.mark(t.grad, Component.TEMPORARIES)

    # -- hooks: gradients as they are accumulated, recompute as it runs ---------------------
    def _install_hooks(self) -> None:
        tr = self.tracker

        def accumulated(p):
            if self.error is None and p.grad is not None:
                try:
                    tr.mark(p.grad, Component.GRADIENTS)
                except Exception as exc:
                    self.error = f"{exc.__class__.__name__}: {exc}"

        for p in self._module_params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(accumulated))

        # A module's forward running inside a backward pass is a checkpointed chunk's recompute.
        def pre(module, args):
            if torch._C._current_graph_task_id() != -1:
                self.recompute_depth += 1

        def post(module, args, out):
            if torch._C._current_graph_task_id() != -1 and self.recompute_depth:
                self.recompute_depth -= 1

        from torch.nn.modules import module as nn_module
        self._handles.append(nn_module.register_module_forward_pre_hook(pre))
        self._handles.append(nn_module.register_module_forward_hook(post, always_call=True))

        # ZeRO reduces gradients from hooks inside backward: what it allocates there (its
        # reduce bucket) is a gradient-reduction buffer, not a backward temporary
        wrapper = getattr(self.engine, "optimizer", None)
        for name in _REDUCTION_METHODS:
            fn = getattr(wrapper, name, None) if wrapper is not None else None
            if fn is None or name in vars(wrapper):
                continue

            def phased(*a, _fn=fn, **k):
                self.enter("reduce_grads")
                try:
                    return _fn(*a, **k)
                finally:
                    self.leave("reduce_grads")
            setattr(wrapper, name, phased)
            self._unwrap.append((wrapper, name))

    def _remove_hooks(self) -> None:
        for obj, name in self._unwrap:
            try:
                delattr(obj, name)
            except Exception:
                pass
        self._unwrap = []
        for h in self._handles:
            try:
                h.remove()
            except Exception:
                pass
        self._handles = []
        self.recompute_depth = 0


def _engine_device(engine):
    dev = getattr(engine, "device", None)
    try:
        dev = torch.device(dev) if dev is not None else None
    except Exception:
        dev = None
    if dev is None:
        p = next(module_of(engine).parameters(), None)
        dev = p.device if p is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _wrapper_component(attr: str) -> Component:
    name = attr.lower()
    for words, component in _WRAPPER_WORDS:
        if any(w in name for w in words):
            return component
    return Component.OTHER


def _tensors(value, depth: int = 0):
    """Tensors in a value and in the lists, tuples and dicts inside it (a few levels)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
