"""The corrections one profile applies to one decomposition, read once (Corrections), and the
one that concerns only the interval: terms measured on another GPU widen it (of_profile)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from .engine import EngineTerms
from .interval import Intervals
from .section import StepTermsSection
from .step import DATA_PARALLEL, StepTerms


# A calibrated profile's own validation runs (neox_perf/profile_validation.py, the manifest's
# sections.Validation): once there are enough, their residuals give its interval.
VALIDATION_MIN_RUNS = 5  # an 80% interval needs a tail on each side: fewer cannot place one


def of_profile(profile) -> Tuple[StepTerms, Optional[Intervals]]:
    """The step terms and intervals a profile's manifest carries (identity and None without);
    a calibrated profile's interval from its own validation runs comes first. ``profile``: a
    neox_perf.profile.protocol.Profile.

    Terms measured on one GPU and applied to another (a description transferred to another
    GPU, or a profile whose end-to-end runs came from elsewhere) keep their values, but the
    intervals widen by the section's `other_gpu_widen`: the operator error measured when one
    GPU's samples predict another's (benchmarks/transfer_gpu.py)."""
    manifest = profile.manifest
    section = manifest.step_terms or StepTermsSection()
    terms = section.terms or StepTerms()
    own = manifest.validation
    if own is not None and own.interval is not None and len(own.runs) >= VALIDATION_MIN_RUNS:
        # measured on this profile's own machine: nothing to widen for another GPU
        return terms, Intervals.single(own.interval)
    intervals = section.regime_intervals()
    if intervals is not None and section.fitted_gpu:
        gpu = profile.facts.gpu_name
        if gpu and not _same_gpu(section.fitted_gpu, gpu):
            intervals = intervals.widened(section.other_gpu_widen or 0.0)
    return terms, intervals


def unseen_of(profile) -> Mapping[str, float]:
    """The step terms the profile's fitting runs could not see, with their standard deviations
    (StepTermsSection.unseen_terms; corrections/unseen.py). Empty where the interval is the
    profile's own validation runs': measured with these terms on its own machine, those
    residuals already hold what the terms miss there."""
    manifest = profile.manifest
    own = manifest.validation
    if own is not None and own.interval is not None and len(own.runs) >= VALIDATION_MIN_RUNS:
        return {}
    section = manifest.step_terms or StepTermsSection()
    return dict(section.unseen_terms or {}) if section.terms is not None else {}


def _same_gpu(a: str, b: str) -> bool:
    norm = lambda s: "".join(ch for ch in s.lower() if ch.isalnum()).replace("nvidia", "")
    return norm(a) == norm(b)


@dataclass(frozen=True)
class Corrections:
    """Every correction a profile applies to one decomposition, read once: the step terms, the
    engine terms where they apply (a calibration measured them in this precision), and the
    interval per regime. estimate applies them in the package's order (corrections/__init__)."""

    step: StepTerms = StepTerms()
    engine: Optional[EngineTerms] = None
    intervals: Optional[Intervals] = None

    @classmethod
    def of(cls, profile, decomp, step: Optional[StepTerms] = None) -> "Corrections":
        """``step``: step terms to apply in place of the profile's own (fitting passes trials)."""
        own, intervals = of_profile(profile)
        return cls(own if step is None else step, EngineTerms.of(profile, decomp), intervals)

    def measured_collective(self, call) -> Optional[float]:
        """Seconds of a collective as the engine's own run timed it, where a calibration measured
        it for this group (order 5): it replaces the sampled or link-model price and takes no
        step term -- the run already had whatever they correct. None: price it from the profile."""
        if self.engine is None:
            return None
        if call.purpose == "mp_allreduce":
            return self.engine.tp_allreduce(call)
        if call.purpose in DATA_PARALLEL:
            return self.engine.dp_collective(call)
        return None
