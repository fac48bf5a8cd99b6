"""Rich text for `neox-perf check`: what the config builds, the verdicts, the prediction."""
from __future__ import annotations

from typing import Optional

from rich import box
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

GIB = 2 ** 30
LEVEL_STYLE = {"ok": "green", "warning": "yellow", "fail": "bold red", "error": "bold red"}
EVENT_GLYPH = {"forward": ("F", "cyan"), "backward": ("B", "magenta"), "send_act": (">", "yellow"),
               "send_grad": ("<", "yellow"), "grad_allreduce": ("R", "red"),
               "tied_allreduce": ("T", "red"), "optimizer": ("O", "green"),
               "allgather": ("G", "blue")}


def _n(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def _s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def render(result, console) -> None:
    cfg, d = result.config, result.derived
    m, p, t = cfg.model, cfg.parallel, cfg.training
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("files", ", ".join(cfg.files))
    head.add_row("model", f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads"
                          f"{f' ({m.num_kv_heads} kv)' if m.num_kv_heads != m.num_attention_heads else ''}, "
                          f"seq {m.seq_length}, {m.norm}, {m.pos_emb}, {m.activation}, "
                          f"{'untied' if m.no_weight_tying else 'tied'} head")
    head.add_row("layout", f"{p.world_size} GPUs ({p.world_size_source}) = pipe {p.num_stages} x "
                           f"model {p.model_parallel_size} x data {p.data_parallel_size}")
    head.add_row("batch", f"micro {t.micro_batch_size} x accumulation {t.gradient_accumulation_steps} x "
                          f"dp {p.data_parallel_size} = {t.train_batch_size} samples/step, {t.precision}, "
                          f"ZeRO {t.zero_stage}, checkpointing {'on' if t.checkpoint_activations else 'off'}")
    vocab = f"raw {result.vocab.size} ({result.vocab.source})"
    if d is not None:
        vocab += f" -> padded {d.padded_vocab}"
    head.add_row("vocab", vocab)
    if result.facts is not None:
        f = result.facts
        head.add_row("cluster", f"{result.profile_name}: {f.gpu_name}, {f.gpu_memory_bytes / GIB:.0f} GiB, "
                                f"{f.gpus_per_node} GPUs/node")
        if f.samples_from:
            head.add_row("samples", f.samples_from)
    if d is not None:
        head.add_row("parameters", f"{d.params.unique:,} total ({_n(d.params.unique)}); "
                                   f"NeoX logs {d.params.neox_logged:,}")
    console.print(Panel(head, title="neox-perf check", title_align="left"))

    if d is not None:
        table = Table(title="Pipeline stages (per GPU)", title_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True,
                      pad_edge=False)
        for col in ("stage", "specs", "blocks", "params", "weights", "grads", "optim",
                    "activ.", "total", "of GPU"):
            table.add_column(col, justify="right" if col != "specs" else "left")
        for s in d.stages:
            mem = s.memory
            share = f"{mem.total / mem.capacity:.0%}" if mem.capacity else "-"
            style = "bold red" if mem.capacity and mem.total > mem.capacity else None
            table.add_row(str(s.index), f"[{s.start},{s.stop})",
                          str(s.transformer_layers), _n(s.params_per_rank), f"{mem.weights / GIB:.1f}G",
                          f"{mem.gradients / GIB:.1f}G",
                          f"{(mem.master_weights + mem.optimizer_states) / GIB:.1f}G",
                          f"{mem.activations / GIB:.1f}G", f"{mem.total / GIB:.1f}G", share, style=style)
        console.print(table)
        console.print(Text("specs: [start, stop) of NeoX's PipelineModule layer list; blocks: transformer "
                           "layers; memory in GiB per GPU at the peak of backward or optimizer step",
                           style="dim"))
    if result.estimate is not None:
        _render_prediction(result, console)
    _render_verdicts(result, console)


def _render_prediction(result, console) -> None:
    est = result.estimate
    pred = result.to_dict()["prediction"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    iv = pred.get("interval_seconds")
    grid.add_row("iteration", f"{_s(est.iteration_seconds)}"
                 + (f"  80% interval {_s(iv[0])} .. {_s(iv[1])}" if iv else "  (no interval: the "
                    "profile carries no measured end-to-end residuals)")
                 + f"  (paper Eq. 7 would say {_s(est.eq7_seconds)})")
    grid.add_row("throughput", f"{pred['tokens_per_second']:,.0f} tokens/s"
                 + (f", {pred['tflops_per_gpu']:.1f} TFLOP/s per GPU" if pred.get("tflops_per_gpu") else "")
                 + (f", MFU {pred['mfu']:.1%}" if pred.get("mfu") else ""))
    if pred.get("run_seconds"):
        hours = pred.get("run_hours_interval")
        gpu_hours = pred.get("run_gpu_hours_interval")
        grid.add_row("whole run", f"{result.run_iterations:,} iterations = {pred['run_seconds'] / 3600:,.1f} h, "
                                  f"{pred['run_gpu_hours']:,.0f} GPU-hours"
                     + (f"  (80%: {hours[0]:,.1f}-{hours[1]:,.1f} h, {gpu_hours[0]:,.0f}-{gpu_hours[1]:,.0f} "
                        f"GPU-hours; size the allocation for the high end)" if hours else ""))
    terms = pred.get("step_terms")
    if terms and terms.get("applied"):
        grid.add_row("step terms", f"{terms['source']}")
    console.print(Panel(grid, title=f"Prediction ({result.profile_name})", title_align="left"))

    table = Table(title="Breakdown (paper Table IX components)", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("component")
    table.add_column("seconds", justify="right")
    for key, value in est.breakdown.items():
        table.add_row(key.replace("_", " "), _s(value))
    console.print(table)
    _render_timeline(est, console)
    top = list(pred["operators"].items())[:8]
    if top:
        ops = Table(title="Heaviest operators on the critical stage (per iteration)", title_justify="left",
                    box=box.SIMPLE_HEAD)
        ops.add_column("operator")
        ops.add_column("seconds", justify="right")
        cover = {c["what"]: c for c in pred.get("coverage") or []}
        if cover:
            ops.add_column("shape vs the samples")
        for name, sec in top:
            op, _, phase = name.rpartition(" ")
            c = cover.get(f"{op} {'fwd' if phase == 'recompute' else phase}")
            ops.add_row(name, _s(sec), *([coverage_cell(c)] if cover else []))
        console.print(ops)
    line = coverage_line(pred.get("coverage") or [])
    if line:
        console.print(line)
    for flag in est.flags:
        console.print(Text(f"extrapolated: {flag.what}: {flag.reason}", style="yellow"))
    for note in pred["notes"]:
        console.print(Text(f"note: {note}", style="yellow"))


def coverage_cell(c) -> Text:
    if c is None:
        return Text("-", style="dim")
    if c["state"] == "extrapolated":
        return Text(f"extrapolated x{c['factor']:.3g}: {c['detail']}", style="yellow")
    return Text(c["state"], style="green" if c["state"] == "sampled" else "")


def coverage_line(rows) -> Optional[Text]:
    """One line: how many operator/phase models predict at, between or past their samples."""
    if not rows:
        return None
    counts: dict = {}
    for c in rows:
        counts[c["state"]] = counts.get(c["state"], 0) + 1
    parts = [f"{counts[k]} {k}" for k in ("sampled", "interpolated", "in range", "extrapolated")
             if counts.get(k)]
    far = max(rows, key=lambda c: (c["state"] == "extrapolated", c["factor"]))
    tail = (f"; furthest out: {far['what']}, {far['detail']} (x{far['factor']:.3g})"
            if far["state"] == "extrapolated" else "")
    return Text(f"operator shapes against the profile's samples: {', '.join(parts)}{tail}",
                style="yellow" if tail else "dim")


def _render_timeline(est, console) -> None:
    width = max(20, min(100, console.width - 10))
    tl = est.timeline
    total = tl.iteration_seconds or 1.0
    rows = [[(".", "dim")] * width for _ in range(len(tl.busy))]
    for ev in tl.events:
        glyph = EVENT_GLYPH.get(ev.kind)
        if glyph is None or ev.end <= ev.start:
            continue
        a = min(width - 1, int(ev.start / total * width))
        b = max(a + 1, min(width, int(round(ev.end / total * width))))
        for i in range(a, b):
            rows[ev.stage][i] = glyph
    console.print(Text("1F1B timeline (F fwd, B bwd, >/< p2p, R grad all-reduce, O optimizer, "
                       "G all-gather)", style="bold"))
    for s, row in enumerate(rows):
        line = Text(f"stage {s:>2} ")
        for ch, style in row:
            line.append(ch, style=style)
        console.print(line)


def _render_verdicts(result, console) -> None:
    for v in result.verdicts:
        console.print(Text(f"{v.level.upper():8} {v.line()}", style=LEVEL_STYLE.get(v.level)))
    for w in result.warnings:
        console.print(Text(f"{'NOTE':8} {w}", style="dim"))
    from .profile_warnings import render as profile_warnings
    profile_warnings(result.profile_warnings, console)
