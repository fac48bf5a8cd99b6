"""What the rest of neox-perf asks of a cluster profile.

Two kinds implement it: a sampled profile (predictors/sampled.ClusterProfile, the regressors
trained on one cluster's samples) and a cluster description's (predictors/transfer.
TransferredProfile, a sampled base profile's predictions moved to other hardware);
predictors/profile.load_profile returns either. estimate, plan, the run analysis and the
renderers use these members and nothing else, so a stand-in (the tests') is any object that
has them.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Mapping, Optional, Protocol, Tuple

from .facts import ClusterFacts
from .manifest import Manifest
from .values import BatchPrediction, Coverage, Prediction, ProfileInfo


class Profile(Protocol):
    name: str
    path: Path  # its directory (a description's: its directory or YAML file)
    facts: ClusterFacts  # the hardware predicted for
    manifest: Manifest  # a description's: its base's, with its own name, facts and transfer
    collective_dtype: str  # the element type its collective samples count (fp16, fp32, ...)
    base: Optional["Profile"]  # the sampled profile a description's predictions stand on

    def predict(self, op: str, phase: str, features: Mapping[str, float]) -> Prediction:
        """Seconds of one operator call on one rank (features: opspec.OPS[op].features)."""

    def predict_many(self, op: str, phase: str, features: Mapping[str, object]) -> BatchPrediction:
        """predict over arrays of features (broadcast together)."""

    def predict_collective(self, kind: str, elements: float, nodes: int, gpus_per_node: int) -> Prediction:
        """Seconds of one collective over nodes x gpus_per_node ranks."""

    def coverage(self, op: str, phase: str, features: Mapping[str, float]) -> Coverage:
        """How the samples behind a prediction cover its shape."""

    def operators(self) -> List[Tuple[str, str]]:
        """The (operator, phase) pairs it can predict."""

    def collectives(self) -> List[str]:
        """The collectives it can predict."""

    def info(self) -> ProfileInfo:
        """Its name, GPU and provenance in one line, for listings."""
