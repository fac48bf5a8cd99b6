"""A measured collective is predicted in the element width its profile was measured in."""
from types import SimpleNamespace

from neox_perf.runs.prediction import predict_call


class _Profile:
    def __init__(self, collective_dtype=None):
        self.facts = SimpleNamespace(gpus_per_node=4)
        self.collective_dtype = collective_dtype or "fp16"  # what the published samples count
        self.asked = []

    def predict_collective(self, op, elements, nodes, gpn):
        self.asked.append(elements)
        return SimpleNamespace(seconds=1e-3, extrapolated=False, reason="")


def _elements(profile, dtype):
    predict_call(profile, "allreduce", "comm", {"elements": 1000, "nodes": 1, "gpus_per_node": 2}, dtype)
    return profile.asked[-1]


def test_fp16_profiles_see_fp32_traffic_as_twice_the_elements():
    assert _elements(_Profile(), "fp32") == 2000
    assert _elements(_Profile(), "bf16") == 1000


def test_a_profile_measured_in_fp32_takes_fp32_elements_as_they_are():
    assert _elements(_Profile("fp32"), "fp32") == 1000
    assert _elements(_Profile("fp32"), "fp16") == 500
