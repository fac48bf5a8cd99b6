"""Wrapping deepspeed.initialize and the engine it returns.

`deepspeed.initialize` is replaced by a wrapper that calls the original, then attaches a
Session to the engine. The engine's methods are wrapped per instance (instance attributes
shadow the class's), so other engines and the DeepSpeed classes are untouched and
unwrapping is deleting the attributes again:
- PipelineEngine: `train_batch` is the iteration; a per-instance copy of
  `_INSTRUCTION_MAP` labels forward/backward/send/recv/reduce/optimizer instructions.
- DeepSpeedEngine: `forward`, `backward`, `step`, `allreduce_gradients` are labelled; an
  iteration runs from the first training forward (grad enabled) or backward after an
  optimizer step to the end of the step() that advanced `global_steps` (a
  gradient-accumulation boundary); evaluation forwards in between start nothing.
Labels are torch.profiler ranges entered only inside profiling windows.
"""
from __future__ import annotations

import functools
import threading

from . import failures

_ATTR = "_neox_perf_wrapped"
_lock = threading.Lock()
_session = None

_PIPE_PHASES = {
    "ForwardPass": "forward", "BackwardPass": "backward", "OptimizerStep": "optimizer_step",
    "ReduceGrads": "reduce_grads", "ReduceTiedGrads": "reduce_tied_grads",
    "LoadMicroBatch": "load_micro_batch", "SendActivation": "send_activations",
    "RecvActivation": "recv_activations", "SendGrad": "send_grads", "RecvGrad": "recv_grads",
}


def patch_deepspeed(module) -> None:
    original = module.initialize
    if getattr(original, _ATTR, False):
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        result = original(*args, **kwargs)
        _attach(result, args, kwargs)
        return result

    setattr(initialize, _ATTR, True)
    initialize._neox_perf_original = original
    module.initialize = initialize


def _attach(result, args, kwargs) -> None:
    global _session
    try:
        engine = result[0] if isinstance(result, (tuple, list)) else result
        with _lock:
            if _session is None:
                from . import settings
                from .session import Session
                _session = Session(settings.read())
        if _session.engine is None:
            _session.attach(engine, args, kwargs)
        elif _session.engine is not engine:
            _session.note("a second deepspeed.initialize was not hooked (only the first engine is)")
    except Exception as exc:
        if _session is not None:
            _session.fail("attaching to the DeepSpeed engine", exc)
        else:
            failures.report_failure("attaching to the DeepSpeed engine", exc)


def current_session():
    return _session


# ---- engine wrappers -------------------------------------------------------------------------

_MISSING = object()


def _set(engine, name, value, saved) -> None:
    # Straight into the instance dict: nn.Module.__setattr__ would do the same for a
    # function, and a dict entry is exactly what unwrapping has to remove again.
    saved[name] = engine.__dict__.get(name, _MISSING)
    engine.__dict__[name] = value


def wrap_engine(engine, session) -> None:
    from .engine_facts import is_pipeline
    saved = {}
    if is_pipeline(engine):
        _wrap_pipeline(engine, session, saved)
    else:
        _wrap_plain(engine, session, saved)
    engine.__dict__["_neox_perf_saved"] = saved


def unwrap_engine(engine) -> None:
    saved = engine.__dict__.pop("_neox_perf_saved", {})
    for name, old in saved.items():
        if old is _MISSING:
            engine.__dict__.pop(name, None)
        else:
            engine.__dict__[name] = old


def _wrap_pipeline(engine, s, saved) -> None:
    train_batch = engine.train_batch

    def wrapped_train_batch(*args, **kwargs):
        if not s.live:
            return train_batch(*args, **kwargs)
        s.begin_iteration()
        try:
            out = train_batch(*args, **kwargs)
        except BaseException:
            s.end_iteration(ok=False)
            raise
        s.end_iteration()
        return out

    table = {}
    for instr, fn in type(engine)._INSTRUCTION_MAP.items():
        phase = _PIPE_PHASES.get(instr.__name__, instr.__name__.lower())
        table[instr] = _labelled(fn, phase, s)
    _set(engine, "train_batch", wrapped_train_batch, saved)
    _set(engine, "_INSTRUCTION_MAP", table, saved)


def _labelled(fn, phase, s):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not s.live:
            return fn(*args, **kwargs)
        rf = s.enter(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            s.leave(rf)
    return run


def _wrap_plain(engine, s, saved) -> None:
    import torch
    forward, backward, step = engine.forward, engine.backward, engine.step

    def wrapped_forward(*args, **kwargs):
        if not s.live:
            return forward(*args, **kwargs)
        # An evaluation forward (no grad) between two steps does not start an iteration.
        if not s.in_iteration and torch.is_grad_enabled():
            s.begin_iteration()
        rf = s.enter("forward")
        try:
            return forward(*args, **kwargs)
        finally:
            s.leave(rf)

    def wrapped_backward(*args, **kwargs):
        if not s.live:
            return backward(*args, **kwargs)
        if not s.in_iteration:
            s.begin_iteration()
        rf = s.enter("backward")
        try:
            return backward(*args, **kwargs)
        finally:
            s.leave(rf)

    def wrapped_step(*args, **kwargs):
        if not s.live:
            return step(*args, **kwargs)
        before = getattr(engine, "global_steps", None)
        rf = s.enter("step")
        try:
            out = step(*args, **kwargs)
        except BaseException:
            s.leave(rf)
            s.end_iteration(ok=False)
            raise
        s.leave(rf)
        if before is None or getattr(engine, "global_steps", None) != before:
            s.end_iteration()
        return out

    _set(engine, "forward", wrapped_forward, saved)
    _set(engine, "backward", wrapped_backward, saved)
    _set(engine, "step", wrapped_step, saved)
    if hasattr(engine, "allreduce_gradients"):
        _set(engine, "allreduce_gradients", _labelled(engine.allreduce_gradients, "reduce_grads", s),
             saved)
