"""What trace_map works on: profiler events and the run facts that give them meaning.

`Event` is one profiler event (a torch op, a user range, an autograd node, a collective),
built from a kineto result by profiling.extract_events or read back from a recorded trace
(JSON). `MapContext` carries what the run knows: layer widths, parallel layout, dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class Event:
    """One profiler event. `shapes`/`concrete` may be read lazily from a raw kineto event:
    only the few events a rule looks at pay for converting them."""

    __slots__ = ("id", "name", "parent", "thread", "start", "dur", "device", "seq", "fwd_thread",
                 "_shapes", "_concrete", "_raw")

    def __init__(self, id: int, name: str, parent: Optional[int], thread: int, start: float,
                 dur: float, device: float = 0.0, shapes: Optional[list] = None, seq: int = -1,
                 fwd_thread: int = 0, concrete: Optional[list] = None, raw=None):
        self.id, self.name, self.parent, self.thread = id, name, parent, thread
        self.start, self.dur, self.device = start, dur, device  # microseconds
        self.seq, self.fwd_thread = seq, fwd_thread
        self._shapes, self._concrete, self._raw = shapes, concrete, raw

    @property
    def shapes(self) -> list:
        if self._shapes is None:
            self._shapes = _plain_shapes(self._raw.shapes()) if self._raw is not None else []
        return self._shapes

    @property
    def concrete(self) -> list:
        if self._concrete is None:
            self._concrete = _plain_values(self._raw.concrete_inputs()) if self._raw is not None else []
        return self._concrete

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        return cls(id=int(d["id"]), name=str(d["name"]), parent=d.get("parent"),
                   thread=int(d.get("thread", 0)), start=float(d["start"]), dur=float(d["dur"]),
                   device=float(d.get("device", 0.0)), shapes=list(d.get("shapes") or []),
                   seq=int(d.get("seq", -1)), fwd_thread=int(d.get("fwd_thread", 0) or 0),
                   concrete=list(d.get("concrete") or []))

    def to_dict(self) -> dict:
        out = {"id": self.id, "name": self.name, "parent": self.parent, "thread": self.thread,
               "start": round(self.start, 3), "dur": round(self.dur, 3)}
        if self.device:
            out["device"] = round(self.device, 3)
        if self.shapes:
            out["shapes"] = self.shapes
        if any(v is not None for v in self.concrete):
            out["concrete"] = self.concrete
        if self.seq >= 0:
            out["seq"] = self.seq
        if self.fwd_thread:
            out["fwd_thread"] = self.fwd_thread
        return out


def _plain_shapes(shapes) -> list:
    return [list(s) if isinstance(s, (list, tuple)) else [] for s in (shapes or ())]


def _plain_values(values) -> list:
    out = []
    for v in values or ():
        if v is None or isinstance(v, (bool, int, float, str)):
            out.append(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
            out.append(list(v))
        else:
            out.append(None)
    return out


@dataclass(frozen=True)
class Dims:
    """Model widths on one tensor-parallel rank; what turns a GEMM into linear1..final."""

    hidden: Optional[int] = None
    qkv: Optional[int] = None  # linear1 n
    ffn_out: Optional[int] = None  # linear3 n
    ffn_in: Optional[int] = None  # linear4 k
    vocab: Optional[int] = None  # linear_final n
    hidden_local: Optional[int] = None  # linear2 k
    source: str = "none"  # config | trace | none


@dataclass(frozen=True)
class Groups:
    """Sizes and placement the collectives' features need."""

    dp: int = 1
    mp: int = 1
    stages: int = 1
    stage: int = 0
    local_world: Optional[int] = None  # ranks per node


@dataclass(frozen=True)
class MapContext:
    dims: Dims = Dims()
    groups: Groups = Groups()
    device: str = "cpu"
    dtype: str = "fp32"
    optimizer_params: Optional[int] = None
