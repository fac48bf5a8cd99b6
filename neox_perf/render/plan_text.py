"""Rich text for `neox-perf plan`: the ranked layouts, the user's own, and time against GPUs."""
from __future__ import annotations

from rich import box
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

GIB = 2 ** 30
DASH = "\u2014"


def _s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def _interval(iv) -> str:
    return f"{iv[0]:.2f}-{iv[1]:.2f}" if iv else DASH


def _hours(h) -> str:
    return DASH if h is None else f"{h:,.0f}" if h >= 10 else f"{h:,.1f}"


def render(result, console) -> None:
    from .profile_warnings import render as profile_warnings
    plan, f = result.plan, result.facts
    if not plan.admissible:
        for line in plan.no_layout.values():
            console.print(Text(f"neox-perf: {line}", style="bold red"), soft_wrap=True)
        profile_warnings(result.profile_warnings, console)
        return
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("files", ", ".join(result.files))
    head.add_row("cluster", f"{result.profile_name}: {f.gpu_name}, {f.gpu_memory_bytes / GIB:.0f} GiB, "
                            f"{f.gpus_per_node} GPUs/node")
    head.add_row("GPUs", ", ".join(str(g) for g in plan.gpus))
    iters = f"{plan.train_iters:,} iterations" if plan.train_iters else "no train_iters (time per batch)"
    head.add_row("keeps", f"global batch {plan.global_batch} ({plan.global_batch_source}); {iters}; "
                          f"memory at most {plan.memory_limit:.0%} of the GPU")
    rejected = ", ".join(f"{n:,} {code.replace('_', ' ')}" for code, n in plan.rejected.items())
    head.add_row("searched", f"{plan.evaluated:,} layouts in {plan.seconds:.1f} s: {plan.admissible:,} "
                             f"admissible, {plan.predicted:,} timed, {plan.bounded:,} skipped by a lower "
                             f"bound, {plan.duplicates:,} duplicate partitions"
                 + (f"; rejected: {rejected}" if rejected else ""))
    console.print(Panel(head, title="neox-perf plan", title_align="left"))

    multi = len(plan.gpus) > 1
    table = Table(title="Layouts by predicted time to train" + (" (* Pareto front of time and "
                  "GPU-hours)" if multi else ""), title_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    shown = list(result.shown)
    base = [b for b in plan.baselines if b.candidate is not None]
    extra = [(str(b.rank) if b.rank else "-", b.candidate, "bold cyan" if b.reason is None else "red")
             for b in base if b.candidate not in shown]
    pareto = [(f"{c.rank}", c, None) for c in plan.candidates
              if multi and c.pareto and c not in shown][:10]
    rows = [(str(c.rank), c, "bold cyan" if any(b.candidate is c for b in base) else None)
            for c in shown] + pareto + extra
    cols, hidden = _columns(console.width, multi, rows)
    for name, _, left in cols:
        table.add_column(name, justify="left" if left else "right", no_wrap=True)
    for rank, c, style in rows:
        star = "*" if multi and c.pareto else ""
        table.add_row(*[fn(c, rank + star) for _, fn, _ in cols], style=style)
    console.print(table)
    console.print(Text("pp-mp-dp: pipe x model x data parallel (/pp0: no pipeline engine); batch: "
                       "difference from the kept global batch; mem: largest stage's share of GPU "
                       "memory; run h, GPU-h: train_iters at the kept batch; interval: — until "
                       "the profile carries one. Highlighted: your own layout."
                       + (f" Hidden at this width: {', '.join(hidden)} (wider terminal or --json)."
                          if hidden else ""), style="dim"))
    if plan.collapsed:
        console.print(Text(f"{plan.collapsed} layouts differ from a row above only in a setting that "
                           f"changes nothing predicted (partition +N, ZeRO a/b): folded into it",
                           style="dim"))
    best = plan.candidates[0] if plan.candidates else None
    if any(c.tp_across_nodes for _, c, _ in rows):
        inside = next((c for c in plan.candidates if not c.tp_across_nodes), None)
        console.print(Text(f"{TP_ACROSS}: tensor parallelism spans nodes -- every layer's all-reduces cross the "
                           "inter-node network, and check warns on it"
                           + (f"; the best layout with tensor parallelism inside a node ranks {inside.rank} "
                              f"({inside.layout.short()}, {_s(inside.iteration_seconds)})"
                              if inside is not None and best is not None and best.tp_across_nodes else ""),
                           style="yellow"))
    if plan.within_interval and best is not None:
        lo, hi = best.interval_seconds
        console.print(Text(f"ranks 1-{plan.within_interval + 1} lie within rank 1's 80% interval "
                           f"({_interval(best.interval_seconds)} s): the prediction's error could "
                           f"reorder them; choose among them by memory headroom or simplicity",
                           style="yellow"))
    for b in plan.baselines:
        note = f"; {b.note}" if b.note else ""
        if b.candidate is None:
            console.print(Text(f"your layout on {b.gpus} GPUs: {b.reason}{note}", style="yellow"))
        elif b.reason:
            console.print(Text(f"your layout on {b.gpus} GPUs ({b.layout.short()}): {b.reason}{note}",
                               style="yellow"))
        elif b.rank is not None:
            console.print(Text(f"your layout on {b.gpus} GPUs ({b.layout.short()}) ranks {b.rank} of "
                               f"{plan.admissible:,}{note}", style="cyan"))
    for line in plan.no_layout.values():
        console.print(Text(line, style="yellow"))
    profile_warnings(result.profile_warnings, console)
    if multi:
        _chart(plan, console)
    if result.written:
        keys = ", ".join(k.replace("_", "-") for k in result.overlay) or "no key changes"
        console.print(Text(f"wrote {result.written}: merge it after your files ({keys})",
                           style="green"))


TP_ACROSS = "^"  # marks a layout whose tensor-parallel group spans nodes

_PART = {"type:transformer|mlp": "type", "parameters": "params", "uniform": "uniform"}


def _partition_cell(c, r) -> str:
    """The partition method, and +N for the N others folded into this row (same prediction)."""
    l = c.layout
    if l.num_stages <= 1:
        return DASH
    others = {e.pipe_partition_method for e in c.equivalent} - {l.pipe_partition_method}
    return _PART.get(l.pipe_partition_method, l.pipe_partition_method) + (f"+{len(others)}" if others else "")


def _k(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _columns(width: int, multi: bool, rows):
    """(header, cell, left-aligned) per column. On a narrow terminal the columns with the
    highest drop level go first; 0 is never dropped."""
    L = lambda c: c.layout
    cands = [c for _, c, _ in rows]
    any_diff = any(c.batch_difference for c in cands)
    any_pipe = any(L(c).num_stages > 1 for c in cands)
    any_interval = any(c.interval_seconds for c in cands)
    cols = [
        ("rank", lambda c, r: r, False, 0),
        ("GPUs", lambda c, r: str(L(c).gpus), False, 0 if multi else None),
        ("pp-mp-dp", lambda c, r: L(c).short() + ("/pp0" if L(c).pipe_parallel_size == 0 else "")
         + (TP_ACROSS if c.tp_across_nodes else ""), True, 0),
        ("micro x acc", lambda c, r: f"{L(c).train_micro_batch_size_per_gpu}x"
                                     f"{L(c).gradient_accumulation_steps}", True, 0),
        ("batch", lambda c, r: f"{c.batch_difference:+d}" if c.batch_difference else "=", False,
         0 if any_diff else 9),
        ("ckpt", lambda c, r: "on" if L(c).checkpoint_activations else "off", True, 0),
        ("ZeRO", lambda c, r: "/".join(str(z) for z in sorted({L(c).zero_stage}
                                                               | {e.zero_stage for e in c.equivalent})),
         False, 0),
        ("partition", _partition_cell, True, 0 if any_pipe else 9),
        ("iter", lambda c, r: _s(c.iteration_seconds), False, 0),
        ("80% interval", lambda c, r: _interval(c.interval_seconds), False, 2 if any_interval else 5),
        ("tokens/s", lambda c, r: _k(c.tokens_per_second), False, 3),
        ("MFU", lambda c, r: DASH if c.mfu is None else f"{c.mfu:.1%}", False, 1),
        ("mem", lambda c, r: f"{c.max_memory_fraction:.0%}", False, 0),
        ("dominant", lambda c, r: c.dominant, True, 1),
        ("run h", lambda c, r: _hours(None if c.run_seconds is None else c.run_seconds / 3600),
         False, 4),
        ("GPU-h", lambda c, r: _hours(c.gpu_hours), False, 0),
    ]
    cols = [c for c in cols if c[3] is not None]
    every = [h for h, *_ in cols if h not in ("batch", "partition", "80% interval")]

    def need(cs):
        return sum(max([len(h)] + [len(fn(c, r + "*")) for r, c, _ in rows]) + 2 for h, fn, *_ in cs)

    for level in (9, 5, 4, 3, 2, 1):
        if need(cols) <= width:
            break
        cols = [c for c in cols if c[3] < level]
    kept = {h for h, *_ in cols}
    return [(h, fn, left) for h, fn, left, _ in cols], [h for h in every if h not in kept]


def _chart(plan, console) -> None:
    """Best predicted time to train per GPU count, as horizontal bars."""
    best = {}
    for c in plan.candidates:
        g = c.layout.gpus
        if g not in best or c.seconds_per_batch < best[g].seconds_per_batch:
            best[g] = c
    if not best:
        return
    width = max(10, min(50, console.width - 45))
    top = max(c.seconds_per_batch for c in best.values())
    console.print(Text("time to train vs GPUs (best layout per GPU count)", style="bold"))
    for g in sorted(best):
        c = best[g]
        bar = "\u2588" * max(1, round(c.seconds_per_batch / top * width))
        value = (f"{c.run_seconds / 3600:,.0f} h, {c.gpu_hours:,.0f} GPU-h" if c.run_seconds
                 else f"{c.seconds_per_batch:.2f} s per batch")
        line = Text(f"{g:>6} GPUs ")
        line.append(bar.ljust(width), style="green" if c.pareto else "cyan")
        line.append(f" {value}  {c.layout.short()}")
        console.print(line)
