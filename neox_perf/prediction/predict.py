"""The one prediction pipeline: derived model -> per-stage operators -> timed 1F1B iteration.

`check`, `validate`, `plan` and the run hook all predict through `predict()`, so a change to
how stages are shaped or timed reaches every command at once. Loading a cluster (a profile
name, a profile directory or a cluster description file) happens once, in `load_cluster`,
whose failures are one line naming the cluster and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..errors import ProfileError, UsageError
from .estimate import IterationEstimate, estimate, span_unseen
from .operators import FP32_FROM_FP16, Decomposition, decompose, stage_shapes
from ..profile.protocol import Profile
from ..profile.sections import Calibration

__all__ = ["Prediction", "stage_shapes", "predict", "update_seconds", "load_cluster", "calibration"]


@dataclass(frozen=True)
class Prediction:
    decomposition: Decomposition  # what each stage runs, untimed
    estimate: IterationEstimate  # the timed iteration
    # an fp32 run on a GPU: whether its matmuls were priced as TF32, who said so, and where the
    # default was taken the other pricing's iteration (predictors/achievable.Fp32Matmuls)
    fp32_matmuls: Optional[object] = None

    @property
    def iteration_seconds(self) -> float:
        return self.estimate.iteration_seconds


def predict(cfg, derived, profile: Profile, *, precision: Optional[str] = None,
            transformer_layers: Optional[Sequence[int]] = None,
            timeline_events: bool = True, tf32: Optional[bool] = None,
            tf32_source: str = "", price_other: bool = True) -> Prediction:
    """Time one training iteration of ``cfg`` (already derived) on ``profile``'s cluster.

    precision: what the run really computes in when that differs from the config (the
    reference workload runs fp32 on a CPU); default the config's.
    timeline_events: False for callers that read no event of the 1F1B timeline (the planner):
    the same prediction, its timeline's events left out.
    tf32: whether an fp32 run's matmuls ran as TF32, where the caller knows (a hooked run's
    record; tf32_source says so); default the cluster's, else achievable.DEFAULT_TF32. Where the
    default is taken, the iteration is priced the other way too and the 80% interval reaches it
    (price_other: False for callers that read no interval -- the planner's per-stage bounds;
    it also leaves out pricing the terms the profile's runs could not see at their ends,
    estimate.span_unseen, which widens the interval the same way).
    """
    decomp, limits = _decomposed(cfg, derived, profile, precision, transformer_layers, tf32, tf32_source)
    if FP32_FROM_FP16 in decomp.notes:  # the samples were 16-bit only where limits rescaled them
        note = limits.note() if limits is not None else None
        decomp = replace(decomp, notes=tuple(note if n == FP32_FROM_FP16 else n
                                             for n in decomp.notes if n != FP32_FROM_FP16 or note))
    est = estimate(decomp, profile, limits=limits, events=timeline_events)
    if price_other:  # the step terms the profile's runs could not see, at their ends
        est = span_unseen(decomp, profile, est, limits)
    matmuls = limits.fp32_matmuls if limits is not None else None
    if price_other and matmuls is not None and not matmuls.known:
        est, matmuls = _reach_the_other(decomp, profile, limits, est, matmuls)
    return Prediction(decomp, est, matmuls)


def _reach_the_other(decomp, profile, limits, est, matmuls):
    """(estimate, Fp32Matmuls) where nobody said how the fp32 run's matmuls run: the same
    iteration priced the other way (TF32 <-> IEEE fp32), its 80% interval widened on that side
    to reach it. A profile without an interval keeps none; the other price is still reported."""
    from ..predictors import achievable
    other = achievable.other_limits(limits)
    if other is None:
        return est, matmuls
    seconds = estimate(decomp, profile, limits=other, events=False).iteration_seconds
    if est.interval_seconds:
        lo, hi = est.interval_seconds
        est = replace(est, interval_seconds=(min(lo, seconds), max(hi, seconds)))
    return est, replace(matmuls, other_seconds=seconds)


def _decomposed(cfg, derived, profile: Profile, precision=None, transformer_layers=None,
                tf32: Optional[bool] = None, tf32_source: str = ""):
    from ..predictors import achievable
    decomp = decompose(cfg, derived.padded_vocab, stage_shapes(derived, transformer_layers),
                       precision=precision)
    # one rule for every command: the run's precision priced on the profile's GPU, no call
    # faster than its achievable rate (refused in one line where that cannot be done honestly)
    return decomp, achievable.limits(profile, decomp.precision, tf32, tf32_source)


def update_seconds(cfg, derived, profile: Profile):
    """Per stage, (gradient sync, optimizer step, parameter all-gather) seconds per iteration
    and the replicas' wait for the slowest per second of the stage's work, as predict() times
    them (its estimate's stages: grad_allreduce, optimizer, param_allgather, dp_wait) and
    nothing else of the iteration."""
    from .estimate import stage_tails
    decomp, limits = _decomposed(cfg, derived, profile)
    return stage_tails(decomp, profile, limits=limits)


def calibration(profile: Profile) -> Calibration:
    """Where and how a calibrated profile's samples were timed (its manifest's `calibration`:
    dtype, device, ...); all None for the bundled profiles and descriptions."""
    return profile.manifest.calibration or Calibration()


def load_cluster(name: Optional[str]) -> Optional[Profile]:
    """A cluster profile by bundled/user name, profile directory or description file; None for
    None. A cluster that cannot be used (missing, unreadable, malformed: a ProfileError) is one
    UsageError line naming it and the fix: the command line named it. Anything else is a bug
    and stays one."""
    if name is None:
        return None
    from ..predictors.profile import load_profile
    try:
        return load_profile(name)
    except ProfileError as exc:  # the profile layer raises one-line errors of its own
        raise UsageError(_unknown_cluster(name) or exc.line()) from None


def _unknown_cluster(name: str) -> Optional[str]:
    """A better line than "calibrate it" for a name that is not there: a path that does not
    exist, or a profile name one typo away from a known one."""
    import difflib
    import os
    if os.path.exists(name):
        return None  # it is there: the profile layer's own reason stands
    if os.sep in name or name.endswith((".yml", ".yaml")):
        from ..predictors.cluster_file import bundled_description
        stem = os.path.splitext(os.path.basename(name))[0]
        if bundled_description(stem) is not None:  # e.g. clusters/dgx-a100.yml typed elsewhere
            return (f"--cluster {name}: no such file here; {stem} is a bundled description "
                    f"(fix: --cluster {stem}, from any directory)")
        return (f"--cluster {name}: no such file or directory (fix: check the path, or name a "
                f"profile from `neox-perf clusters`)")
    from ..predictors.profile import list_profiles
    known = [p.name for p in list_profiles()]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    if near:
        return (f"--cluster {name}: no such cluster profile; did you mean {near[0]}? "
                f"(fix: --cluster {near[0]})")
    return None
