"""engine_fit's dp_arrival: the plain pass's peers, side by side per repeat, give the share of
their work that a replica waits for the slowest at a gradient all-reduce."""
import pytest

pytest.importorskip("numpy")

from neox_perf.predictors.fitting.engine_fit import ARRIVAL_MIN_REPEATS, fit_arrival  # noqa: E402
from neox_perf.prediction.corrections import EngineSection  # noqa: E402


def _shapes(pairs):
    half = len(pairs) // 2
    rows = [{"forward": 1.0, "busy": busy, "arrival": f * busy} for f, busy in pairs]
    # two shapes, and a repeat stored before the peers were (no arrival): left out
    return {"a": {"repeats": rows[:half] + [{"forward": 1.0}]}, "b": {"repeats": rows[half:]}}


def test_the_wait_per_second_of_work_over_every_repeat_of_every_shape():
    # (share, work): a small shape's hiccup (30% of 0.1 s) weighs as its work
    pairs = [(0.01, 2.0), (0.02, 1.0), (0.02, 2.0), (0.03, 1.0), (0.04, 2.0), (0.05, 1.0), (0.30, 0.1)]
    term = fit_arrival(_shapes(pairs), 2)
    waited = 0.02 + 0.02 + 0.04 + 0.03 + 0.08 + 0.05 + 0.03
    assert term["fraction"] == pytest.approx(waited / 9.1) and term["repeats"] == 7
    assert term["processes"] == 2 and term["median"] == pytest.approx(0.03)
    assert term["quartiles"] == pytest.approx([0.02, 0.045])
    section = EngineSection.parse({"precision": "fp32", "dp_arrival": term})
    assert section.arrival.fraction == pytest.approx(term["fraction"]) and section.arrival.extra["repeats"] == 7


def test_no_term_without_peers_or_with_too_few_repeats():
    assert fit_arrival(_shapes([(0.02, 1.0)] * 10), 1) is None  # one process: nothing to compare
    assert fit_arrival(_shapes([(0.02, 1.0)] * 10), None) is None
    assert fit_arrival(_shapes([(0.02, 1.0)] * (ARRIVAL_MIN_REPEATS - 1)), 2) is None
    assert fit_arrival({"a": {"forward": 1.0}}, 2) is None  # an engine file from before
