"""Rich text for `neox-perf check`: what the config builds, the verdicts, the prediction."""
from __future__ import annotations

import shlex
from typing import Optional

from rich import box
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..config.verdicts import LEVELS
from ..prediction.network import DESCRIBE_YOUR_NODES
from .check_line import _cluster_arg
from .op_names import PHASES, neox_name, split

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


def _hours(seconds: float) -> str:
    h = seconds / 3600.0
    return f"{h:,.0f} h" if h >= 100 else f"{h:,.1f} h" if h >= 0.1 else f"{h:.2g} h"


def _s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def title(console, text: str) -> None:
    """A table's title on a line of its own: rich would wrap a table title to the table's width."""
    console.print(Text(text, style="bold"), overflow="ellipsis", no_wrap=True)


def verdict_line(result) -> Text:
    summary = result.summary()
    level = summary["level"]
    return Text(f"{level.upper():8} {summary['text']}", style=LEVEL_STYLE.get(level))


def mlp_text(m) -> str:
    """The MLP width NeoX builds, and the rule that made it (what silently changes the size)."""
    from ..derive.params import mlp_widths
    try:
        out, inp = mlp_widths(m)
    except ValueError:
        return "MLP ?"
    if m.intermediate_size:
        asked = f"intermediate_size {m.intermediate_size}"
    elif m.expansion_factor:
        asked = f"{m.expansion_factor:g} x hidden"
    else:
        asked = "4 x hidden"
    if m.is_gated:  # ParallelMLP: int(width x 2/3), halved by the gate (transformer.py:134-143)
        return f"MLP {inp} ({m.activation} gated: 2/3 of {asked}, halved)"
    return f"MLP {inp} ({asked})"


def model_text(m, opts=None) -> str:
    heads = f"{m.num_attention_heads} heads" + (
        f" / {m.num_kv_heads} kv" if m.num_kv_heads != m.num_attention_heads else "")
    experts = ""
    if m.moe_num_experts > 1:
        top_k = getattr(opts, "moe_top_k", 1)
        every = "every layer" if m.moe_expert_interval == 1 else f"every {m.moe_expert_interval} layers"
        experts = f", {m.moe_num_experts} experts (top-{top_k}, {every})"
    return (f"{m.num_layers} layers, hidden {m.hidden_size}, {mlp_text(m)}, {heads}{experts}, "
            f"seq {m.seq_length}, {m.norm}, {m.pos_emb}, {'untied' if m.no_weight_tying else 'tied'} head")


def render(result, console) -> None:
    cfg, d = result.config, result.derived
    m, p, t = cfg.model, cfg.parallel, cfg.training
    console.print(verdict_line(result))
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("files", ", ".join(cfg.files))
    head.add_row("model", model_text(m, d.options if d is not None else None))
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
        if result.network is not None:
            net = result.network.line()
            if result.network.how == "sampled":  # the nodes the samples ran on, not yours
                net += f"; for other nodes: {DESCRIBE_YOUR_NODES}"
            head.add_row("network", net)
    if d is not None:
        head.add_row("parameters", f"{d.params.unique:,} total ({_n(d.params.unique)}); "
                                   f"NeoX logs {d.params.neox_logged:,}")
    console.print(Panel(head, title="neox-perf check", title_align="left"))

    if d is not None:
        table = Table(title="Pipeline stages (per GPU)", title_justify="left", box=box.SIMPLE_HEAD, padding=0,
                      pad_edge=False)
        from ..derive.memory import columns
        names = ("weights", "grads", "optim", "activ.", "logits/buffers", "device overhead")
        # Headers wrap at their space or slash, never mid-word; below ~100 columns the specs
        # column (in --json) gives way so that every figure stays whole at 80.
        specs = console.width >= 100
        for col in ("stage",) + (("specs",) if specs else ()) + ("blocks", "params") + names + ("total", "of GPU"):
            table.add_column(col.replace("/", "/\n").replace(" ", "\n"),
                             justify="right" if col != "specs" else "left", no_wrap=True)
        fit = result.memory_fit  # derive/fit.py: red above the band, yellow inside it
        for s in d.stages:
            mem = s.memory
            cols = columns(mem)
            usable = mem.usable_capacity
            share = f"{mem.device_total / usable:.0%}" if usable else "-"
            style = None
            if fit is not None and s.index in fit.over:
                style = "bold red"
            elif fit is not None and mem.device_total > fit.band[0]:
                style = "yellow"
            table.add_row(str(s.index), *([f"[{s.start},{s.stop})"] if specs else []), str(s.transformer_layers),
                          _n(s.params_per_rank), *(_gib(cols[n]) for n in names),
                          _gib(mem.device_total), share, style=style)
        console.print(table)
        console.print(Text(("specs: [start, stop) of NeoX's PipelineModule layer list; " if specs else
                            "specs ([start, stop) of NeoX's layer list): --json, or 100+ columns; ")
                           + "blocks: transformer "
                           "layers; memory in GiB per GPU at the stage's peak (backward or optimizer "
                           "step): what is live then, plus the device overhead above it (allocator "
                           "reserve, CUDA context, NCCL); total: what nvidia-smi shows; of GPU: of "
                           "what CUDA lets a process use", style="dim"))
    if result.estimate is not None:
        _render_prediction(result, console)
    _render_suggestion(result, console)
    _render_verdicts(result, console)


def _gib(n: float) -> str:
    """GiB at a width the 80-column stage table holds: 0.1 GiB below 100, whole GiB above."""
    g = n / GIB
    return f"{g:.1f}G" if g < 99.95 else f"{g:.0f}G"


def _render_prediction(result, console) -> None:
    est = result.estimate
    pred = result.prediction_dict()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    iv = pred.get("interval_seconds")
    grid.add_row("iteration", f"{_s(est.iteration_seconds)}"
                 + (f"  80% interval {_s(iv[0])} .. {_s(iv[1])} ({est.regime})" if iv else "  (no interval: the "
                    "profile carries no measured end-to-end residuals)")
                 + f"  (the closed form of arXiv 2509.22832, Eq. 7: {_s(est.eq7_seconds)})")
    if est.unseen_terms:
        grid.add_row("", "the interval spans step terms the profile's runs could not see: "
                     + ", ".join(f"{n} {_s(lo)} .. {_s(hi)}" for n, (lo, hi) in est.unseen_terms.items()))
    grid.add_row("throughput", f"{pred['tokens_per_second']:,.0f} tokens/s"
                 + (f", {pred['tflops_per_gpu']:.1f} TFLOP/s per GPU" if pred.get("tflops_per_gpu") else "")
                 + (f", MFU {pred['mfu']:.1%}" if pred.get("mfu") else ""))
    if pred.get("neox_log"):
        grid.add_row("NeoX log", pred["neox_log"]["line"])
    if pred.get("run_seconds"):
        hours = pred.get("run_hours_interval")
        gpu_hours = pred.get("run_gpu_hours_interval")
        grid.add_row("whole run", f"{result.run_iterations:,} iterations = {pred['run_seconds'] / 3600:,.1f} h, "
                                  f"{pred['run_gpu_hours']:,.0f} GPU-hours"
                     + (f"  (80%: {hours[0]:,.1f}-{hours[1]:,.1f} h, {gpu_hours[0]:,.0f}-{gpu_hours[1]:,.0f} "
                        f"GPU-hours; size the allocation for the high end)" if hours else ""))
        grid.add_row("Slurm", f"sbatch --time={pred['slurm_time']}"
                              + (" (the interval's high end)" if hours else ""))
    terms = pred.get("step_terms")
    if terms and terms.get("applied"):
        grid.add_row("step terms", f"{terms['source']}")
    console.print(Panel(grid, title=f"Prediction ({result.profile_name})", title_align="left"))

    _render_breakdown(est, console)
    _render_timeline(est, console)
    top = list(pred["operators"].items())[:8]
    if top:
        title(console, "Heaviest operators on the critical stage, per iteration")
        ops = Table(box=box.SIMPLE_HEAD)
        ops.add_column("operator (NeoX)")
        ops.add_column("paper", style="dim")
        ops.add_column("phase")
        ops.add_column("seconds", justify="right")
        cover = {c["what"]: c for c in pred.get("coverage") or []}
        if cover:
            ops.add_column("vs samples")
        for name, sec in top:
            op, phase = split(name)
            c = cover.get(f"{op} {'fwd' if phase == 'recompute' else phase}")
            ops.add_row(neox_name(op), op, PHASES.get(phase, phase), _s(sec),
                        *([coverage_cell(c)] if cover else []))
        console.print(ops)
        console.print(Text("paper: the operator names of arXiv 2509.22832, Table I", style="dim"))
    line = coverage_line(pred.get("coverage") or [])
    if line:
        console.print(line)
    for flag in est.flags:
        console.print(Text(f"{getattr(flag, 'kind', 'extrapolated')}: {flag.what}: {flag.reason}",
                           style="yellow"))
    for note in pred["notes"]:
        console.print(Text(f"note: {note}", style="yellow"))


def _render_breakdown(est, console) -> None:
    """The iteration as the rows that add up to it (+ ... = iteration), what the pipeline row
    holds, and the other figures of the paper's Table IX apart (they overlap the sum); rows of
    zero seconds are left out."""
    c, b = est.timeline.components, est.breakdown
    total = est.iteration_seconds or 1.0
    title(console, "Breakdown of one iteration (arXiv 2509.22832, Table IX)")
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("", width=1)
    table.add_column("component")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    additive = [
        ("pipeline: the last backward ends", c.get("pipeline_seconds", b.get("pipeline", 0.0))),
        ("tied-embedding all-reduce, exposed", c.get("tied_allreduce_exposed", 0.0)),
        ("gradient all-reduce, exposed", c.get("dp_allreduce_exposed", b.get("dp_allreduce_exposed", 0.0))),
        ("update: optimizer step, ZeRO all-gather", c.get("update_seconds", b.get("update", 0.0))),
    ]
    inside = [
        ("  compute on the critical stage", c.get("critical_compute_seconds", 0.0)),
        ("    of which tensor-parallel all-reduce", b.get("mp_allreduce", 0.0)),
        ("  its pipeline sends", c.get("pp_p2p_seconds", 0.0)),
        ("  bubble: waiting for other stages", c.get("bubble_seconds", 0.0)),
    ]
    for i, (name, value) in enumerate(additive):
        if value <= 0:
            continue
        table.add_row("+", name, _s(value), f"{value / total:.0%}")
        if i == 0:
            for sub, v in inside:
                if v > 0:
                    table.add_row("", Text(sub, style="dim"), Text(_s(v), style="dim"),
                                  Text(f"{v / total:.0%}", style="dim"))
    table.add_row("=", Text("iteration", style="bold"), Text(_s(est.iteration_seconds), style="bold"),
                  "100%")
    console.print(table)
    shown = {"pipeline", "bubble", "dp_allreduce_exposed", "update", "mp_allreduce", "pp_p2p"}
    other = [(OTHER_NAMES.get(k, k.replace("_", " ")), v) for k, v in b.items()
             if k not in shown and v > 0]
    if other:
        console.print(Text("not in the sum (per micro-batch, or overlapping it): "
                           + "; ".join(f"{name} {_s(v)}" for name, v in other), style="dim"))
    sources = getattr(est, "collective_sources", None) or {}
    if sources:
        console.print(Text("collectives priced: " + "; ".join(
            f"{SOURCE_NAMES.get(k, k.replace('_', ' '))}: {v}" for k, v in sources.items()), style="dim"))


SOURCE_NAMES = {"dp_allreduce": "gradient all-reduce", "dp_allgather": "ZeRO all-gather",
                "mp_allreduce": "tensor-parallel all-reduce", "pp_p2p": "pipeline sends",
                "pp_allgather": "pipeline all-gather", "tied_allreduce": "tied-embedding all-reduce"}


OTHER_NAMES = {
    "encoder_forward": "one layer forward", "encoder_backward": "one layer backward",
    "stage_forward_max": "slowest stage forward", "stage_backward_max": "slowest stage backward",
    "dp_allreduce": "gradient all-reduce, whole", "dp_allgather": "ZeRO all-gather",
    "dp_wait": "waiting for the slowest replica at the gradient all-reduce",
    "optimizer": "optimizer step", "tied_allreduce": "tied-embedding all-reduce, whole",
    "engine": "engine terms",
}


def _render_suggestion(result, console) -> None:
    """What it would take (out of memory) or a faster layout: ready to paste."""
    s = result.suggestion
    if s is None:
        for line in result.no_layout:
            console.print(Text(line, style="yellow"))
        return
    c = s.candidate
    if s.reason == "fits":
        head = f"What it would take: the fastest layout that fits {s.where()}(quick search)"
    else:
        head = "A faster layout of these GPUs (quick search)"
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("layout", s.describe())
    iv = c.interval_seconds
    grid.add_row("iteration", _s(c.iteration_seconds)
                 + (f"  80% interval {_s(iv[0])} .. {_s(iv[1])}" if iv else "")
                 + (f"  ({s.speedup:.2f}x faster than yours)" if s.speedup else ""))
    grid.add_row("memory", f"{c.max_memory_fraction:.0%} of the GPU at most")
    if c.run_seconds:
        grid.add_row("whole run", f"{_hours(c.run_seconds)}, {_hours(c.gpu_hours * 3600)[:-2]} GPU-hours")
    grid.add_row("searched", f"{s.searched} layouts in {s.seconds:.2f} s; `neox-perf plan` ranks "
                             f"them all")
    console.print(Panel(grid, title=head, title_align="left"))
    # outside the panel, a flag never split from its value: the lines paste into a shell
    if s.too_many_flags:  # too many to paste: plan writes them into a file
        keys = s.set_flags().count("--set ")
        console.print(Text(f"{keys} keys change: write them to best.yml, then add it to your config files:",
                           style="bold"))
        command = s.plan_command(result.config.files, _cluster_arg(result), result.request_flags)
        for line in _packed(_shell_words(command), console.width):
            console.print(Text(line), overflow="ignore", crop=False)
        return
    console.print(Text("paste after your config files:", style="bold"))
    for line in paste_lines(s.set_flags().split(" --"), console.width):
        console.print(Text(line), overflow="ignore", crop=False)


def _shell_words(command: str):
    """The command's words as a shell takes them back (quoted where they need it), each --set
    on one line with its KEY=VALUE."""
    words = []
    for w in shlex.split(command):
        if words and words[-1] == "--set":
            words[-1] += " " + shlex.quote(w)
        else:
            words.append(shlex.quote(w))
    return words


def _packed(words, width: int):
    """Words packed into lines of at most `width`, continued with a backslash."""
    lines, cur = [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) + 2 > width - 2:
            lines.append(cur + " \\")
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    return lines + ([cur] if cur else [])


def paste_lines(flags, width: int):
    """`--flag value` items packed into lines of at most `width`, continued with a backslash."""
    words = [f if f.startswith("--") else "--" + f for f in flags if f]
    return ["  " + line for line in _packed(words, width)]


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
    title(console, "1F1B timeline of one iteration")
    console.print(Text("F forward, B backward, >/< pipeline send, R gradient all-reduce, "
                       "O optimizer, G ZeRO all-gather", style="dim"))
    for s, row in enumerate(rows):
        line = Text(f"stage {s:>2} ")
        for ch, style in row:
            line.append(ch, style=style)
        console.print(line)


def _render_verdicts(result, console) -> None:
    """Notes first, then the verdicts from the least to the most severe: the last line is the
    worst finding (a config NeoX refuses never ends on an OK)."""
    for w in result.warnings:
        console.print(Text(f"{'NOTE':8} {w}", style="dim"))
    from .profile_warnings import render as profile_warnings
    profile_warnings(result.profile_warnings, console)
    for v in sorted(result.verdicts, key=lambda v: LEVELS.index(v.level)):
        console.print(Text(f"{v.level.upper():8} {v.line()}", style=LEVEL_STYLE.get(v.level)))
