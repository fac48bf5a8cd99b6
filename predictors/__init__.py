"""Per-cluster operator and collective time regressors (neox_perf.predictors).

Loading and predicting need numpy only; training (`python -m neox_perf.predictors.fitting.train`)
needs scikit-learn and XGBoost, imported only there.
"""
from neox_perf.profile.facts import ClusterFacts, Link
from neox_perf.profile.values import BatchPrediction, Prediction, ProfileInfo

from .errors import ProfileError, SampleFileError
from .profile import list_profiles, load_profile
from .sampled import ClusterProfile

__all__ = [
    "BatchPrediction", "ClusterFacts", "ClusterProfile", "Link", "Prediction", "ProfileError",
    "ProfileInfo", "SampleFileError", "list_profiles", "load_profile",
]
