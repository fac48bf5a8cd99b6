"""Does a layout fit the GPU, and by how much: the one rule `check`, `plan` and the renderers
call (derive/memory.py predicts each stage's device total, what nvidia-smi will show).

The verdict is a band around the usable capacity, sized by how far measured device peaks fell
from their predictions (the 95th percentiles of the under- and of the over-prediction,
cross-validated by model on the 60 nvidia-smi peaks of BigScience's BLOOM layout search) and
by where its layouts went both ways (`python benchmarks/memory_bloom.py` prints both;
docs/memory.md):
  FAIL     the fullest stage's device total is above the usable capacity by more than the
           predictions ran over (OVER_FRACTION): it does not fit even if it is over-predicted;
  WARNING  "may run out of memory": within UNDER_FRACTION below the usable capacity, or above
           it by less than OVER_FRACTION -- measured runs went both ways there (BLOOM layouts
           ran at up to 79 GiB on 80 GiB A100s, another ran out predicted at 65 GiB);
  OK       below the band.

"headroom" means one thing everywhere: usable capacity minus the device total, in bytes
(negative: predicted above it) -- StageMemory.headroom and MemoryFit.headroom.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .device_memory import usable
from .memory import StageMemory, columns

# python benchmarks/memory_bloom.py, the wider of two edges each: the 95th percentile of the
# cross-validated under- (7.3%) and over-prediction (10.8%) of nvidia-smi's peak, and where
# measured runs went both ways (a layout ran out of memory predicted at 82.9% of usable: 206B,
# tp 4 pp 12 dp 8, bf16; none that ran was predicted past 98.2%)
UNDER_FRACTION = 0.171
OVER_FRACTION = 0.108


@dataclass(frozen=True)
class MemoryFit:
    """The verdict on the fullest stage."""
    level: str  # "ok" | "warning" | "fail"
    stage: int  # the fullest stage
    device_total: int  # its predicted device total, bytes
    usable: int  # what CUDA lets a process allocate, bytes
    headroom: int  # usable - device_total, bytes (negative: predicted above it)
    band: Tuple[int, int]  # device totals in (band[0], band[1]] are WARNING, above band[1] FAIL
    dominant: str  # the stage table's largest column at the peak (derive/memory.COLUMNS)
    over: Tuple[int, ...] = ()  # the stages above band[1]

    @property
    def fits(self) -> bool:
        return self.level != "fail"


def band(usable_bytes: int) -> Tuple[int, int]:
    """(WARNING from, FAIL from) for a GPU that lets a process allocate `usable_bytes`."""
    return int(usable_bytes * (1.0 - UNDER_FRACTION)), int(usable_bytes * (1.0 + OVER_FRACTION))


def fail_above(capacity: int, limit: Optional[float] = None) -> int:
    """Device totals above this many bytes FAIL on a GPU of `capacity` data-sheet bytes (with
    `limit`, a share of the usable capacity the caller will not go above)."""
    cap = usable(capacity)
    high = band(cap)[1]
    return high if limit is None else min(high, int(limit * cap))


def memory_fit(stages: Sequence[StageMemory], capacity: int,
               limit: Optional[float] = None) -> MemoryFit:
    """The verdict for `stages` (each stage's memory) on a GPU of `capacity` data-sheet bytes.
    `limit`: a share of the usable capacity the caller will not go above (plan's
    --memory-headroom): a stage above it fails, whatever the band says."""
    cap = usable(capacity)
    high = fail_above(capacity, limit)
    low = min(band(cap)[0], high)
    worst = max(stages, key=lambda m: m.device_total)
    cols = columns(worst)
    total = worst.device_total
    level = "fail" if total > high else ("warning" if total > low else "ok")
    return MemoryFit(level=level, stage=worst.stage, device_total=total, usable=cap,
                     headroom=cap - total, band=(low, high), dominant=max(cols, key=cols.get),
                     over=tuple(m.stage for m in stages if m.device_total > high))
