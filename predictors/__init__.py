"""Per-cluster operator and collective time regressors (neox_perf.predictors).

Loading and predicting need numpy only; training (`python -m neox_perf.predictors.fitting.train`)
needs scikit-learn and XGBoost, imported only there.
"""
from neox_perf.profile.facts import ClusterFacts, Link

from .errors import ProfileError, SampleFileError
from .profile import BatchPrediction, ClusterProfile, Prediction, ProfileInfo, list_profiles, load_profile

__all__ = [
    "BatchPrediction", "ClusterFacts", "ClusterProfile", "Link", "Prediction", "ProfileError",
    "ProfileInfo", "SampleFileError", "list_profiles", "load_profile",
]
