"""Memory a rank really used, next to what `check` predicts for its pipeline stage.

Measured per rank:
- the persistent state, per component, straight from the engine's tensors: weights,
  gradients, fp32 master weights and optimizer states (each storage counted once);
- the peak: on CUDA `torch.cuda.max_memory_allocated` (what the caching allocator handed
  out, the number `check`'s total models); on CPU torch keeps no allocator statistics, so
  the process's resident high-water mark (VmHWM) less what the process held besides tensors
  when the hook attached (libraries, interpreter: RSS at attach minus the tensors then).

`compare` lines these up with a derive.memory.StageMemory (or its dict) per component.
torch is imported only inside the functions that read tensors.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

COMPONENTS = ("weights", "gradients", "master_weights", "optimizer_states")


def _proc_status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> Optional[int]:
    return _proc_status_bytes("VmRSS")


def resident_peak_bytes() -> Optional[int]:
    peak = _proc_status_bytes("VmHWM")
    if peak is None:
        try:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB
        except Exception:
            return None
    return peak


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
    params = [p for p in engine.module.parameters()]
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
    """Taken when the hook attaches (`baseline`), read at the end (`measure`)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.baseline_resident: Optional[int] = None
        self.baseline_state: Optional[int] = None

    def baseline(self, engine) -> None:
        if self.device_type == "cuda":
            return
        self.baseline_resident = resident_bytes()
        try:
            self.baseline_state = sum(state_bytes(engine).values())
        except Exception:
            self.baseline_state = None

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
            return out
        peak = resident_peak_bytes()
        out["resident_peak_bytes"] = peak
        if peak is not None and self.baseline_resident is not None and self.baseline_state is not None:
            # what the process held besides tensors at attach time is not training memory
            out["peak_bytes"] = max(peak - (self.baseline_resident - self.baseline_state), 0)
            out["source"] = "resident high-water mark (VmHWM) less the non-tensor resident " \
                            "memory at attach"
        else:
            out["peak_bytes"] = None
            out["source"] = "no resident-memory counters on this system"
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
