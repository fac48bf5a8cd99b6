"""Text for `neox-perf calibrate --from-run`: how far off the profile was on the run, before
and after, and where the corrected profile went."""
from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text


def _s(x) -> str:
    if x is None:
        return "-"
    if abs(x) < 1e-3:
        return f"{x * 1e6:.1f} us"
    return f"{x * 1e3:.2f} ms" if abs(x) < 1 else f"{x:.3f} s"


def _e(x, signed: bool = True) -> Text:
    if x is None:
        return Text("-", style="dim")
    style = "green" if abs(x) <= 0.1 else "yellow" if abs(x) <= 0.3 else "red"
    return Text(f"{x * 100:+.1f}%" if signed else f"{x * 100:.1f}%", style=style)


def _verdict(flag) -> Text:
    if flag is None:
        return Text("-", style="dim")
    return Text("lower", style="green") if flag else Text("not lower", style="red")


def render(result, console) -> None:
    d = result.to_dict()
    prof, before, after = d["profile"], d["before"], d["after"]
    if d["method"] == "refit":
        m = d["merged"]
        console.print(f"[bold]Refitted[/bold] {prof['name']} -> {prof['path']}")
        console.print(f"merged {m['added']} new samples of {m['read']} from {d['run_dir']} into "
                      f"{d['store']} (already there: {m['already']}; as the {m['statistic']} of "
                      f"the run's calls, like calibration samples)")
        for why, n in (m.get("skipped") or {}).items():
            console.print(f"[yellow]skipped[/yellow] {n} samples: {why}")
        eng = d.get("engine")
        if eng and eng.get("rows"):
            console.print("engine terms refitted with the run's rows: " + ", ".join(
                f"{k} +{n}" for k, n in sorted(eng["rows"].items())))
    else:
        console.print(f"[bold]Level-corrected[/bold] {prof['from']} -> {prof['name']} at {prof['path']}")
        console.print(f"{len(d['factors'] or {})} models scaled by the run's median measured / "
                      f"predicted ratio; {len(d['skipped'] or {})} left as they were")
        st = d.get("step_terms") or {}
        if st:
            drop = "" if st["start"]["dispatch_s"] else ", no host dispatch term (a CPU call's time holds its issue)"
            fitted = (f"; {st['refitted']} refitted on the run: {1e3 * st['value']:.3f} ms"
                      if st.get("refitted") else f"; nothing refitted ({st.get('why')})")
            console.print(f"step terms: in-situ scales 1 (the run's calls are in situ){drop}{fitted}")

    console.print(f"[bold]Prediction error on the run[/bold] (before: {before['profile']}, "
                  f"after: {after['profile']})")
    t = Table(box=box.SIMPLE_HEAD)
    for col in ("", "before", "after", ""):
        t.add_column(col, justify="left" if not col else "right")
    bi, ai = before["iteration"], after["iteration"]
    imp = d["improved"]
    t.add_row("iteration predicted", _s(bi["predicted"]), _s(ai["predicted"]), "")
    t.add_row("iteration measured", _s(bi["measured_median"]), _s(ai["measured_median"]),
              Text("median", style="dim"))
    t.add_row("iteration error", _e(bi["error"]), _e(ai["error"]), _verdict(imp["iteration"]))
    t.add_row("  vs the fastest", _e(bi["error_min"]), _e(ai["error_min"]), "")
    bo, ao = before["operators"], after["operators"]
    t.add_row("operators, median |error|", _e(bo["median_abs_error"], False),
              _e(ao["median_abs_error"], False), _verdict(imp["operators"]))
    t.add_row("  time-weighted", _e(bo["time_weighted_abs_error"], False),
              _e(ao["time_weighted_abs_error"], False), "")
    console.print(t)
    console.print(f"[dim]{ao['compared']} of {ao['of']} mapped operators compared (predicted vs the "
                  f"median of their calls); the iteration vs the job's median without profiling[/dim]")

    engine = [r for r in d.get("fit") or [] if r["op"].startswith("engine ")]
    if engine:
        e = Table(title="Engine terms after the refit, MAPE % (leave-one-out where stated)",
                  title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("term", "rows", "operators alone", "with the term", "what"):
            e.add_column(col, justify="left" if col in ("term", "what") else "right")
        for r in engine:
            v = r["validation_mape"]
            pct = (lambda x: "-" if x is None else f"{100 * x:.1f}")
            e.add_row(r["op"][len("engine "):], str(r["rows"]), pct(v.get("baseline")),
                      pct(v.get("chosen")), Text(r["note"], style="dim"))
        console.print(e)
        if (d.get("engine") or {}).get("rows"):
            console.print("[dim]leave-one-out includes the run's rows: left out, a run row is "
                          "predicted from calibration shapes far from it[/dim]")
    for n in d.get("notes") or []:
        console.print(f"[yellow]note:[/yellow] {n}")
    from .profile_warnings import render as profile_warnings
    profile_warnings(d.get("profile_warnings"), console)
    console.print(f"use it: neox-perf check CONFIG --cluster {d['use']}")
