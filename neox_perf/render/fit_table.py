"""The trainer's validation table (python -m neox_perf.predictors.fitting.train): per op and
phase, the 80/20 split's error of each model kind and the one chosen."""
from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table


def _pct(v) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{100 * v:.1f}"


def print_fit_table(name: str, rows, console=None) -> None:
    """rows: (op, phase, sample rows, fit.FitResult or None, cleaning.DerivedPhase or None), in
    the order to show them."""
    t = Table(title=f"{name}: validation MAPE % (80/20 split)")
    for col in ("op", "phase", "rows", "baseline", "pure trees", "baseline+trees", "chosen", "model"):
        t.add_column(col, justify="right" if col not in ("op", "phase", "model") else "left")
    for op, phase, n, result, derived in rows:
        if derived is not None:
            t.add_row(op, phase, "-", "-", "-", "-", "-", f"{derived.source_phase} model ({derived.scale})")
            continue
        v = result.validation
        t.add_row(op, phase, str(n), _pct(v.get("baseline")), _pct(v.get("pure_trees")),
                  _pct(v.get("baseline_plus_trees")), _pct(v.get("chosen")), result.chosen)
    (console or Console(width=140)).print(t)
