"""Rich text for `neox-perf report` and the end of `neox-perf run`: predicted vs measured."""
from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text


def _s(x) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        return f"{x * 1e6:.1f} us"
    return f"{x * 1e3:.2f} ms" if abs(x) < 1 else f"{x:.3f} s"


def _e(x) -> Text:
    if x is None:
        return Text("-", style="dim")
    style = "green" if abs(x) <= 0.1 else "yellow" if abs(x) <= 0.3 else "red"
    return Text(f"{x * 100:+.0f}%", style=style)


def _em(x) -> Text:
    """A memory error: to a tenth of a percent (the memory target is a few percent)."""
    if x is None:
        return Text("-", style="dim")
    style = "green" if abs(x) <= 0.03 else "yellow" if abs(x) <= 0.1 else "red"
    return Text(f"{x * 100:+.1f}%", style=style)


def _feats(f: dict) -> str:
    return " ".join(f"{k}={int(v) if float(v).is_integer() else v}" for k, v in sorted(f.items()))


def render(result, console) -> None:
    data = result.to_dict()
    if "run" in data:  # `neox-perf run`: the launch, then its report
        run = data["run"]
        console.print(f"[bold]neox-perf run[/bold] {' '.join(run['command'])}  "
                      f"exit code {run['exit_code']}  run dir {data['run_dir']}")
        if data.get("report_error"):
            console.print(f"[yellow]no report:[/yellow] {data['report_error']}")
            return
        data = data["report"]
    _render_report(data, console)


def _render_report(r: dict, console) -> None:
    lay = r["layout"]
    console.print(f"[bold]Run[/bold] {r['run_dir']}  job {r.get('job') or '-'}  "
                  f"{lay.get('engine')} on {lay.get('world_size')} ranks: pipe {lay.get('stages')} x "
                  f"model {lay.get('mp')} x data {lay.get('dp')}, {lay.get('micro_batches')} "
                  f"micro-batches, {lay.get('dtype')} on {lay.get('device_type')}")
    cfg = r.get("config") or {}
    console.print(f"config: {cfg.get('source') or 'none (' + str(cfg.get('why')) + ')'}"
                  f"    cluster profile: {r.get('cluster') or 'none'}")
    it = r["iteration"]
    m = it["measured"]
    head = Table(title="Iteration time", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("", "predicted", "measured", "error"):
        head.add_column(col, justify="right" if col else "left")
    # the prediction is for the typical iteration (what the run costs): the median first
    head.add_row("typical (median)", _s(it["predicted"]), _s(m["median"]), _e(it["error_median"]))
    head.add_row("fastest", _s(it["predicted"]), _s(m["min"]), _e(it["error_min"]))
    console.print(head)
    console.print(f"[dim]{m['used']} of {m['count']} iterations used; excluded: {m['excluded']}[/dim]")
    hook = m.get("hook_overhead") or {}
    if hook.get("share") is not None:
        console.print(f"[dim]the hook's own time between profiling windows: "
                      f"{_s(hook['per_iteration_seconds'])} per iteration "
                      f"({100 * hook['share']:.3f}% of the median)"
                      + (f", {_s(hook['per_iteration_cpu_seconds'])} of it its own CPU work"
                         if hook.get("per_iteration_cpu_seconds") is not None else "")
                      + "[/dim]")
    if it.get("interval_seconds"):
        lo, hi = it["interval_seconds"]
        console.print(f"80% interval of the prediction: {_s(lo)} .. {_s(hi)}")

    comp = Table(title="Components (Table IX)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("component", "predicted", "measured", "error", "note"):
        comp.add_column(col, justify="right" if col in ("predicted", "measured", "error") else "left")
    for c in r["components"]:
        if c["predicted"] is None and c["measured"] is None:
            continue
        comp.add_row(c["name"], _s(c["predicted"]), _s(c["measured"]), _e(c["error"]),
                     Text(c.get("note") or "", style="dim"))
    console.print(comp)

    _render_memory(r.get("memory") or [], console)
    if r["operators"]:
        ops = Table(title="Operators (largest difference per iteration first)",
                    title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("stage", "op", "features", "calls/it", "predicted", "measured", "error"):
            ops.add_column(col, justify="right" if col not in ("op", "features") else "left")
        for o in r["operators"]:
            ops.add_row(str(o["stage"]), f"{o['op']} {o['phase']}", _feats(o["features"]),
                        f"{o['calls_per_iteration']:.3g}", _s(o["predicted"]), _s(o["measured"]),
                        _e(o["error"]))
        console.print(ops)
    if r["unmapped"]:
        un = Table(title="Not mapped to the decomposition", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("event", "calls/it", "time/it", "why"):
            un.add_column(col, justify="right" if col in ("calls/it", "time/it") else "left")
        for u in r["unmapped"]:
            un.add_row(u["name"], f"{u['calls_per_iteration']:.3g}", _s(u["seconds_per_iteration"]),
                       Text(u["reason"], style="dim"))
        console.print(un)
    cov = r.get("coverage") or []
    if cov:
        console.print("mapped share of forward+backward time: " + ", ".join(
            f"rank {c['rank']} {c['fraction'] * 100:.0f}%" for c in cov if c["fraction"] is not None))
    s = r.get("samples") or {}
    console.print(f"samples stored: {s.get('count', 0)} in {', '.join(s.get('stores') or []) or '-'}")
    for n in r.get("notes") or []:
        console.print(f"[yellow]note:[/yellow] {n}")
    from .profile_warnings import render as profile_warnings
    profile_warnings(r.get("profile_warnings"), console)


def _bytes(x) -> str:
    if x is None:
        return "-"
    return f"{x / 2 ** 30:.2f}G" if abs(x) >= 2 ** 30 else f"{x / 2 ** 20:.1f}M"


def print_memory(rows, title: str, console) -> None:
    """Components down, stages across: predicted / measured and the error (render of
    runs/memory.stage_rows; validate's text uses it too). The title is its own line: the
    table is narrow and would wrap it."""
    console.print(Text(title, style="italic"))
    console.print(memory_table(rows))


def memory_table(rows) -> Table:
    names = [c["component"] for c in rows[0]["components"]
             if any(c2["component"] == c["component"] and (c2["predicted"] or c2["measured"])
                    for r in rows for c2 in r["components"])]
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("component")
    for r in rows:
        table.add_column(f"stage {r['stage']}", justify="right")
    for n in names:
        cells = []
        for r in rows:
            c = next(c for c in r["components"] if c["component"] == n)
            cells.append(Text(f"{_bytes(c['predicted'])} / {_bytes(c['measured'])} ")
                         + _em(c["error"]))
        table.add_row(n.replace("_", " "), *cells)
    table.add_row("peak", *[Text(f"{_bytes(r['predicted'])} / {_bytes(r['measured'])} ") + _em(r["error"])
                            for r in rows], style="bold")
    return table


def _render_memory(rows, console) -> None:
    """Peak live tensor bytes per stage and what was live at it."""
    if not rows:
        return
    print_memory(rows, "Memory per GPU at the peak (predicted / measured, error)", console)
    for r in rows:
        cuda = r.get("cuda") or {}
        extra = (f"; the allocator's own peaks: allocated {_bytes(cuda.get('max_allocated'))}, "
                 f"reserved {_bytes(cuda.get('max_reserved'))}" if cuda else "")
        console.print(f"[dim]stage {r['stage']} (rank {r['rank']}): measured during "
                      f"{r['moment'] or '-'}; predicted peak: {r['predicted_moment']}{extra}[/dim]")
    t = rows[0].get("tracker") or {}
    if t.get("slowdown"):
        console.print(f"[dim]the live-bytes window (iteration {t['iteration']}, every operator "
                      f"through Python) took {t['slowdown']:.1f}x the median iteration; it is left "
                      f"out of the timings[/dim]")
