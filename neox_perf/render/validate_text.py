"""Text for `neox-perf validate`: predicted vs measured per config and per component."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text

from .check_text import coverage_line
from .report_text import print_memory


def _err(v) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def _layout(lay: dict) -> str:
    return (f"pp{lay['pp']} mp{lay['mp']} dp{lay['dp']} mb{lay['micro_batch']}x{lay['grad_accum']} "
            f"s{lay['seq']} h{lay['hidden']} L{lay['layers']} {lay['norm']} {lay['attention']}"
            + (" recompute" if lay["recompute"] else "") + (f" zero{lay['zero']}" if lay["zero"] else ""))


def render(result, console) -> None:
    table = Table(title=f"Predicted vs measured seconds per iteration ({result.cluster}, "
                        f"{result.gpus} processes)", title_justify="left")
    for col in ("config", "layout", "predicted", "80% interval", "measured (median)", "error",
                "fastest", "error"):
        table.add_column(col, justify="left" if col in ("config", "layout") else "right")
    for r in result.results:
        name = ", ".join(c.rsplit("/", 1)[-1] for c in r.config)
        iv = getattr(r, "interval_seconds", None)
        table.add_row(name, _layout(r.layout), f"{r.predicted_seconds:.3f}",
                      f"{iv[0]:.3f} .. {iv[1]:.3f}" if iv else "-",
                      f"{r.measured_median_seconds:.3f}", _err(r.error), f"{r.measured_seconds:.3f}",
                      _err(r.error_fastest))
    console.print(table)
    comp = Table(title="Per component (seconds per iteration, max over stages; predicted / measured)",
                 title_justify="left")
    comp.add_column("config")
    for c in result.component_names:
        comp.add_column(c, justify="right")
    for r in result.results:
        cells = []
        for row in r.components:
            p, m = row["predicted_seconds"], row["measured_seconds"]
            cells.append("-" if p == 0 and m == 0 else f"{p:.3f}/{m:.3f}")
        comp.add_row(", ".join(c.rsplit("/", 1)[-1] for c in r.config), *cells)
    console.print(comp)
    for r in result.results:
        if getattr(r, "memory", None):
            name = ", ".join(c.rsplit("/", 1)[-1] for c in r.config)
            print_memory(r.memory, f"{name}: memory per GPU at the peak (predicted / measured, "
                                   f"error)", console)
    if result.mape is not None:
        console.print(f"against the typical (median) iteration: mean absolute error "
                      f"{100 * result.mape:.1f}% over {len(result.results)} "
                      f"config(s); largest {100 * result.max_abs_error:.1f}%; mean signed "
                      f"{100 * result.mean_signed_error:+.1f}%")
    for r in result.results:
        line = coverage_line(getattr(r, "coverage", None) or [])
        if line is not None:
            console.print(Text(f"{r.config[-1].rsplit('/', 1)[-1]}: ") + line)
        if getattr(r, "machine_speed", None):
            console.print(f"{r.config[-1].rsplit('/', 1)[-1]}: the machine ran at x{r.machine_speed:.3f} the "
                          f"speed its profile describes (its calibration's reference loop, timed around the launch); "
                          f"scaled to that speed the prediction is {_err(r.error_at_machine_speed)}")
        for note in r.notes:
            console.print(f"note ({r.config[-1].rsplit('/', 1)[-1]}): {note}")
    from .profile_warnings import render as profile_warnings
    profile_warnings(result.profile_warnings, console)
