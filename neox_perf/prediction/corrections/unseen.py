"""Step terms the fitting runs could not see, and the interval that spans them (order 8).

A fit returns its prior's neutral value for a term its runs cannot tell (a per-launch host cost
of a layout search of 180B models, never host-bound: docs/cross-cluster.md): not a measurement
of the cluster. A profile whose section names such terms (StepTermsSection.unseen_terms, each
with its posterior standard deviation, predictors/fitting/step_fit.unseen_terms) has every
prediction priced again with each of them at either end of its own 80% range, and the interval
reaches what those prices say -- for the jobs that live on the term, nothing for the others.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, List, Mapping, Tuple

from .step import StepTerms

# the standard normal's 90th percentile: a term's 80% range is its value +- this many sd
Z80 = 1.2815515655446004


def ends(terms: StepTerms, unseen: Mapping[str, float]) -> List[Tuple[str, StepTerms, StepTerms]]:
    """Per unseen term, (name, terms with it at its low end, at its high end): value -+ Z80 sd.
    The low end stops at the term's neutral value (StepTerms(): 0 for a cost, 1 for a scale): a
    prior centred there puts the runs' silence at neutral, and a cost below zero is no time."""
    neutral = StepTerms()
    out = []
    for name, sd in sorted(unseen.items()):
        value = getattr(terms, name)
        if not sd > 0:
            continue
        floor = min(value, getattr(neutral, name))
        out.append((name, replace(terms, **{name: max(floor, value - Z80 * sd)}),
                    replace(terms, **{name: value + Z80 * sd})))
    return out


def spread(seconds: float, priced: Iterable[Tuple[float, float]]) -> Tuple[float, float]:
    """(down, up): how far below and above ``seconds``, relative, the unseen terms reach -- each
    term's pair of prices (at its two ends) moves the prediction, and the moves of independent
    terms add in quadrature, each side on its own (a term that can only add time widens the
    high end alone)."""
    if seconds <= 0:
        return 0.0, 0.0
    down = up = 0.0
    for a, b in priced:
        moves = ((a - seconds) / seconds, (b - seconds) / seconds)
        up += max(0.0, *moves) ** 2
        down += min(0.0, *moves) ** 2
    return min(math.sqrt(down), 0.99), math.sqrt(up)


def widened(interval: Tuple[float, float], by: Tuple[float, float]) -> Tuple[float, float]:
    """The 80% interval (lo, hi seconds) with the unseen terms' spread on each side. The
    residuals that sized it are of runs on which these terms were silent, so they hold nothing
    of it; the two are added end to end, not in quadrature, because nothing shows them
    independent and an interval too narrow gets a job killed (`--format line`'s --time)."""
    lo, hi = interval
    down, up = by
    return lo * (1.0 - down), hi * (1.0 + up)
