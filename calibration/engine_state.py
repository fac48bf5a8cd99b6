"""The objects a DeepSpeed engine holds, found the same way by the hook, the live-bytes
tracker and the reference workload's instrumentation. No torch import."""
from __future__ import annotations


def base_optimizer(engine):
    """The torch optimizer that really steps (under ZeRO / fp16 wrappers)."""
    opt = getattr(engine, "optimizer", None)
    seen = 0
    while opt is not None and seen < 4 and not hasattr(opt, "param_groups"):
        opt = getattr(opt, "optimizer", None)
        seen += 1
    if opt is not None and hasattr(getattr(opt, "optimizer", None), "param_groups") \
            and type(opt).__module__.startswith("deepspeed"):
        opt = opt.optimizer  # FP16_Optimizer & co keep the fp32 master optimizer inside
    return opt


def module_of(engine):
    """The model a DeepSpeed engine wraps (a stand-in engine may be the model itself)."""
    return getattr(engine, "module", None) or engine
