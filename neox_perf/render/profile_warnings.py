"""The warnings a cluster profile carries (neox_perf/profile/disturbance.profile_warnings), drawn
the same way by every command that predicts with one: check, plan, validate, report, calibrate
and calibrate --from-run."""
from __future__ import annotations

from typing import Iterable

from rich.text import Text


def render(warnings: Iterable[str], console) -> None:
    for line in warnings or ():
        console.print(Text(f"{'WARNING':8} {line}", style="bold yellow"))
