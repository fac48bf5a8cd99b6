"""What a cluster profile answers, as plain frozen values; every kind of profile returns these
(predictors/sampled.py, predictors/transfer.py), so nothing above them asks which kind it has."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import numpy as np


@dataclass(frozen=True)
class Prediction:
    seconds: float
    extrapolated: bool
    reason: str = ""
    # where a collective's time comes from (neox_perf.prediction.collective_sources); operators leave it
    # empty, as does a profile whose collectives say neither (a test double, an older kind). A
    # correction fitted against one source rides on that source's prices alone
    # (corrections.StepTerms.collective): a link model lacks what a sampled fabric already shows.
    source: str = ""


@dataclass(frozen=True)
class BatchPrediction:
    seconds: np.ndarray
    extrapolated: np.ndarray  # bool per query
    reasons: Tuple[str, ...]  # "" where not extrapolated

    def __len__(self) -> int:
        return len(self.seconds)

    def __getitem__(self, i: int) -> Prediction:
        return Prediction(float(self.seconds[i]), bool(self.extrapolated[i]), self.reasons[i])


@dataclass(frozen=True)
class Coverage:
    """A query against the samples of the model that predicts it."""

    state: str  # sampled | interpolated (between grid points) | in range (no grid) | extrapolated
    factor: float  # how far past the sampled range, as a ratio (1.0 inside)
    detail: str  # the feature furthest outside, e.g. "m=8192 vs the sampled maximum 2048"


@dataclass(frozen=True)
class ProfileInfo:
    name: str
    path: Path
    gpu: str
    provenance: str
    description: bool = False  # a cluster description (transferred), not a sampled profile
