"""The persistent training state a rank holds, per component, straight from the engine's tensors:
weights, gradients, fp32 master weights and optimizer states (each storage counted once), and
on CUDA the caching allocator's own peaks.

The peak of live tensor bytes and what was live at it are the live-bytes window's
(calibration/live_memory.py, taken by the session); this is the cheap, exact reading of the
state that outlives iterations, taken when the hook attaches and at the end.
`compare` lines it up with a derive.memory.StageMemory (or its dict) per component.
torch is imported only inside the functions that read tensors.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

COMPONENTS = ("weights", "gradients", "master_weights", "optimizer_states")


def _storage_bytes(tensors: Iterable, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device.type)
            size = storage.nbytes()
        except Exception:
            key, size = (id(t), "?"), t.numel() * t.element_size()
        if key in seen or size == 0:
            continue
        seen.add(key)
        total += size
    return total


def _optimizer_tensors(opt) -> Iterable:
    state = getattr(opt, "state", None) or {}
    for per_param in state.values():
        if isinstance(per_param, dict):
            for v in per_param.values():
                if hasattr(v, "untyped_storage"):
                    yield v


def state_bytes(engine) -> Dict[str, int]:
    """Bytes of the rank's persistent training state, per component, from its tensors."""
    from .engine_facts import base_optimizer
    seen: set = set()
    from neox_perf.calibration.engine_state import module_of
    params = [p for p in module_of(engine).parameters()]
    out = {"weights": _storage_bytes(params, seen),
           "gradients": _storage_bytes((p.grad for p in params), seen)}
    opt = base_optimizer(engine)
    master: List = []
    if opt is not None:
        master = [p for g in getattr(opt, "param_groups", []) for p in g["params"]]
    # A separate fp32 copy exists only when the optimizer updates tensors the module does not
    # hold (fp16/bf16 wrappers, ZeRO's flat partitions); otherwise these are the weights again.
    out["master_weights"] = _storage_bytes(master, seen)
    out["gradients"] += _storage_bytes((getattr(p, "grad", None) for p in master), seen)
    out["optimizer_states"] = _storage_bytes(_optimizer_tensors(opt), seen) if opt is not None else 0
    return out


class MemoryProbe:
    """Read at the end (`measure`): the persistent state, and on CUDA the allocator's peaks."""

    def __init__(self, device_type: str):
        self.device_type = device_type

    def measure(self, engine) -> Dict[str, Any]:
        out: Dict[str, Any] = {"device_type": self.device_type}
        try:
            out["components"] = state_bytes(engine)
        except Exception as exc:
            out["components"] = None
            out["components_error"] = f"{exc.__class__.__name__}: {exc}"
        if self.device_type == "cuda":
            import torch
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated())
            out["reserved_peak_bytes"] = int(torch.cuda.max_memory_reserved())
            out["source"] = "torch.cuda.max_memory_allocated"
        else:
            out["peak_bytes"] = None
            out["source"] = "no allocator statistics on this device: the live-bytes window measures the peak"
        return out


def _get(pred, key):
    return pred.get(key) if isinstance(pred, dict) else getattr(pred, key, None)


def compare(measured: Dict[str, Any], predicted) -> List[Dict[str, Any]]:
    """Rows {component, predicted, measured, error}; `predicted` is a StageMemory or its dict."""
    rows = []
    comps = measured.get("components") or {}
    for name in COMPONENTS:
        p, m = _get(predicted, name), comps.get(name)
        rows.append({"component": name, "predicted": p, "measured": m, "error": _err(p, m)})
    p = _get(predicted, "persistent")
    m = sum(comps.values()) if comps else None
    rows.append({"component": "persistent", "predicted": p, "measured": m, "error": _err(p, m)})
    p, m = _get(predicted, "total"), measured.get("peak_bytes")
    rows.append({"component": "peak", "predicted": p, "measured": m, "error": _err(p, m),
                 "source": measured.get("source")})
    return rows


def _err(p, m) -> Optional[float]:
    if p is None or m is None or not m:
        return None
    return (p - m) / m
