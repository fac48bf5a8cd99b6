"""Wrapping the engine deepspeed.initialize returned (attach.py wraps initialize itself).

The engine's methods are wrapped per instance (instance attributes shadow the class's), so
other engines and the DeepSpeed classes are untouched and unwrapping is deleting the
attributes again. The wrappers call the session they are given (session.Session); this
module never imports it:
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

_PIPE_PHASES = {
    "ForwardPass": "forward", "BackwardPass": "backward", "OptimizerStep": "optimizer_step",
    "ReduceGrads": "reduce_grads", "ReduceTiedGrads": "reduce_tied_grads",
    "LoadMicroBatch": "load_micro_batch", "SendActivation": "send_activations",
    "RecvActivation": "recv_activations", "SendGrad": "send_grads", "RecvGrad": "recv_grads",
}


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


def _labelled(fn, phase, s, starts=None):
    """``fn`` inside a profiler range named ``phase`` (in a window). ``starts()``: whether a
    call outside an iteration begins one."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not s.live:
            return fn(*args, **kwargs)
        if starts is not None and not s.in_iteration and starts():
            s.begin_iteration()
        rf = s.enter(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            s.leave(rf)
    return run


def _wrap_plain(engine, s, saved) -> None:
    import torch
    forward, backward, step = engine.forward, engine.backward, engine.step

    # An evaluation forward (no grad) between two steps does not start an iteration.
    wrapped_forward = _labelled(forward, "forward", s, starts=torch.is_grad_enabled)
    wrapped_backward = _labelled(backward, "backward", s, starts=lambda: True)

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
