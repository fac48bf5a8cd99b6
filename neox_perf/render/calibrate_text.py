"""Text for `neox-perf calibrate`: what was measured, where the profile went, how well it fits."""
from __future__ import annotations

from rich.table import Table


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _secs(v) -> str:
    return f"{v:.0f} s" if v >= 10 else f"{v:.1f} s"


def _summary(result, console) -> None:
    op, coll, eng, sec = result.operators, result.collectives, result.engine, result.seconds
    console.print(f"[bold]Profile[/bold] {result.cluster} -> {result.profile_path}")
    console.print(f"store {result.store} (plan {result.plan}, {result.device}, {op.get('dtype')}, "
                  f"{op.get('threads')} thread(s))")
    again = f"{op['remeasured']} measured again (marked disturbed), " if op.get("remeasured") else ""
    if op.get("pooled"):
        again += f"{op['pooled']} timed in {op.get('sweeps', 2)} sweeps, "
    console.print(f"operators: {op.get('measured', 0)} measured, {op.get('already_stored', 0)} already stored, "
                  f"{again}{len(op.get('failed', []))} failed of {op.get('points', 0)} ({_secs(sec.get('operators', 0.0))})")
    if "skipped" in coll:
        console.print(f"collectives: skipped ({coll['skipped']})")
    else:
        extra = coll.get("buckets", {})
        console.print(f"collectives: {coll.get('measured', 0) + extra.get('measured', 0)} measured, "
                      f"{coll.get('already_stored', 0) + extra.get('already_stored', 0)} already stored "
                      f"on {coll.get('processes')} processes ({_secs(sec.get('collectives', 0.0))})")
    if eng:
        console.print(f"engine: {eng.get('measured', 0)} shapes measured, {eng.get('already_stored', 0)} "
                      f"already stored ({_secs(sec.get('engine', 0.0))})")
    facts = result.facts
    if facts:
        console.print(f"facts: {facts['gpu_name']}, {facts['gpu_memory_bytes'] / 2**30:.0f} GiB, "
                      f"{facts['gpus_per_node']} per node, {facts['intra_node_link']['name']}")


def _disturbance(result, console) -> None:
    """Whether the machine was quiet while this profile's samples were timed."""
    d = result.disturbance
    if d is None:
        return
    if d.get("flagged"):
        from .profile_warnings import render as profile_warnings
        profile_warnings(result.profile_warnings, console)
        return
    runs = d.get("runs") or []
    last = runs[-1] if runs else {}
    threshold = (last.get("baseline") or {}).get("threshold", 0.0)
    retimed = (last.get("points") or {}).get("retimed")
    if retimed:
        console.print(f"[dim]machine disturbed at times: the {retimed} samples timed then were "
                      f"re-timed once the reference was back within {threshold:.1%} of its time "
                      f"at rest[/dim]")
    else:
        console.print(f"[dim]machine quiet: no sample was timed while the reference strayed more "
                      f"than {threshold:.1%} from its time at rest ({last.get('readings_taken', 0)} "
                      f"readings)[/dim]")
    _steps(result.steps_watched, console)


def _steps(watched, console) -> None:
    """The steps after the operators, each watched whole (calibration/step_watch.py)."""
    if not watched or not watched.get("steps"):
        return
    steps = watched["steps"]
    again = [s for s in steps if s.get("retimed")]
    if again:
        console.print("[dim]run again once the machine was quiet (other processes shared it the "
                      "first time): " + "; ".join(
                          f"{s['step']} ({s['others_share']:.0%} of the CPUs, then "
                          f"{s.get('retime_share') or 0.0:.1%})" for s in again) + "[/dim]")
    shares = [s["others_share"] for s in steps if s.get("others_share") is not None]
    steal = [s["steal_share"] for s in steps if s.get("steal_share") is not None]
    # the hypervisor's share is the platform's (recorded, never re-run for): said beside
    stolen = f"; the hypervisor's steal at most {max(steal):.1%}, recorded" if steal else ""
    if shares and not any(s.get("still_disturbed") for s in steps):
        console.print(f"[dim]{', '.join(s['step'] for s in steps)}: other processes took at most "
                      f"{max(shares):.1%} of the CPUs (limit {watched['limit']:.0%}){stolen}[/dim]")


def render(result, console) -> None:
    _summary(result, console)
    ops = Table(title=f"Validation error per operator, MAPE % on a seeded 80/20 split (fit "
                      f"{_secs(result.seconds.get('fit', 0.0))})", title_justify="left")
    for col in ("op", "phase", "rows", "baseline", "+trees", "chosen", "model"):
        ops.add_column(col, justify="left" if col in ("op", "phase", "model") else "right")
    engine = []
    for row in sorted(result.fit, key=lambda r: (r["phase"] == "comm", r["op"], r["phase"] != "fwd")):
        if row["op"].startswith("engine "):
            engine.append(row)
            continue
        v = row["validation_mape"]
        if row["model"] == "derived":
            ops.add_row(row["op"], row["phase"], "-", "-", "-", "-", f"from {row['note']}")
        elif v.get("chosen") is None:  # too few rows to hold any back
            ops.add_row(row["op"], row["phase"], str(row["rows"]), "-", "-", "-",
                        f"baseline (in-sample {_pct(v.get('baseline_in_sample'))})")
        else:
            ops.add_row(row["op"], row["phase"], str(row["rows"]), _pct(v.get("baseline")),
                        _pct(v.get("baseline_plus_trees")), _pct(v.get("chosen")), row["model"])
    console.print(ops)
    if engine:
        table = Table(title="Engine terms (what a DeepSpeed step adds to the operators), MAPE %",
                      title_justify="left")
        for col in ("term", "rows", "operators alone", "with the term", "what"):
            table.add_column(col, justify="left" if col in ("term", "what") else "right")
        for row in engine:
            v = row["validation_mape"]
            table.add_row(row["op"][len("engine "):], str(row["rows"]), _pct(v.get("baseline")),
                          _pct(v.get("chosen")), row["note"])
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    failed = result.operators.get("failed") or []
    for f in failed[:5]:
        console.print(f"[yellow]not measured[/yellow]: {f['point']}: {f['reason']}")
    if len(failed) > 5:
        console.print(f"... and {len(failed) - 5} more (see --json)")
    _disturbance(result, console)
    console.print(f"use it: neox-perf check CONFIG --cluster {result.cluster}")
