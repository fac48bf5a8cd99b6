"""Rich text for `neox-perf report TRAIN_LOG --config ...`: a NeoX log against the prediction."""
from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text


def _s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.3f} s"


def render(result, console) -> None:
    r = result.to_dict()
    lay = r["layout"]
    console.print(Text(r["verdict"], style="bold"))
    console.print(f"log {r['log']}: {r['logged']['used']} of {r['logged']['intervals']} logged "
                  f"intervals used" + (f" (left out: {r['logged']['excluded']})" if r["logged"]["excluded"] else ""))
    console.print(f"config {', '.join(r['files'])}: {r['world_size']} GPUs = pipe {lay['pipe']} x model "
                  f"{lay['model']} x data {lay['data']}, micro {lay['micro_batch']} x accumulation "
                  f"{lay['accumulation']}; cluster profile {r['cluster']}")
    pred, meas = r["predicted"], r["measured"]
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("", "predicted", "the log"):
        table.add_column(col, justify="left" if not col else "right", no_wrap=not col)
    iv = pred.get("interval_seconds")
    table.add_row("seconds per iteration", _s(pred["iteration_seconds"])
                  + (f" ({_s(iv[0])} .. {_s(iv[1])})" if iv else ""), _s(meas["median_seconds"]))
    nx = pred["neox_log"]
    table.add_row("elapsed time per iteration (ms)", f"{nx['elapsed_time_per_iteration_ms']:.1f}",
                  f"{meas['median_seconds'] * 1000:.1f}")
    table.add_row("samples/sec", f"{nx['samples_per_sec']:.3f}", f"{meas['samples_per_sec']:.3f}")
    if meas.get("approx_flops_per_gpu"):
        from ..neox_log import human_readable_flops
        table.add_row("approx flops per GPU", human_readable_flops(nx["approx_flops_per_gpu"]),
                      human_readable_flops(meas["approx_flops_per_gpu"]))
    console.print(table)
    for note in r.get("notes") or []:
        console.print(Text(f"note: {note}", style="yellow"))
