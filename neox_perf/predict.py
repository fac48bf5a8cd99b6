"""The one prediction pipeline: derived model -> per-stage operators -> timed 1F1B iteration.

`check`, `validate`, `plan` and the run hook all predict through `predict()`, so a change to
how stages are shaped or timed reaches every command at once. Loading a cluster (a profile
name, a profile directory or a cluster description file) happens once, in `load_cluster`,
whose failures are one line naming the cluster and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from .errors import UsageError
from .estimate import IterationEstimate, estimate
from .operators import FP32_FROM_FP16, Decomposition, decompose, stage_shapes

__all__ = ["Prediction", "stage_shapes", "predict", "load_cluster", "calibration"]


@dataclass(frozen=True)
class Prediction:
    decomposition: Decomposition  # what each stage runs, untimed
    estimate: IterationEstimate  # the timed iteration

    @property
    def iteration_seconds(self) -> float:
        return self.estimate.iteration_seconds


def predict(cfg, derived, profile, *, precision: Optional[str] = None,
            transformer_layers: Optional[Sequence[int]] = None) -> Prediction:
    """Time one training iteration of ``cfg`` (already derived) on ``profile``'s cluster.

    precision: what the run really computes in when that differs from the config (the
    reference workload runs fp32 on a CPU); default the config's.
    """
    from .predictors import achievable
    decomp = decompose(cfg, derived.padded_vocab, stage_shapes(derived, transformer_layers),
                       precision=precision)
    # one rule for every command: the run's precision priced on the profile's GPU, no call
    # faster than its achievable rate (refused in one line where that cannot be done honestly)
    limits = achievable.limits(profile, decomp.precision)
    if FP32_FROM_FP16 in decomp.notes:  # the samples were 16-bit only where limits rescaled them
        note = limits.note() if limits is not None else None
        decomp = replace(decomp, notes=tuple(note if n == FP32_FROM_FP16 else n
                                             for n in decomp.notes if n != FP32_FROM_FP16 or note))
    return Prediction(decomp, estimate(decomp, profile, limits=limits))


def calibration(profile) -> dict:
    """Where and how a calibrated profile's samples were timed (its manifest's `calibration`:
    dtype, device, ...); empty for the bundled profiles and descriptions."""
    section = (getattr(profile, "manifest", None) or {}).get("calibration")
    return section if isinstance(section, dict) else {}


def load_cluster(name: Optional[str]):
    """A cluster profile by bundled/user name, profile directory or description file; None for
    None. Every failure is one UsageError line naming the cluster and the fix."""
    if name is None:
        return None
    from .predictors.profile import load_profile
    try:
        return load_profile(name)
    except Exception as exc:  # the profile layer raises one-line errors of its own
        line = getattr(exc, "line", None)
        raise UsageError(line() if callable(line) else str(exc)) from None
