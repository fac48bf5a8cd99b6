"""Text for `neox-perf clusters` (and `clusters --gpus`)."""
from __future__ import annotations

from rich import box
from rich.table import Table

from ..prediction.network import DESCRIBE_YOUR_NODES


def _link(link) -> str:
    return link.name or str(link)


def _num(value, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def render(result, console) -> None:
    if result.gpus is not None:
        _render_gpus(result.gpus, console)
        return
    table = Table(title="Cluster profiles and descriptions (--cluster NAME)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("name", "GPU", "memory", "GPUs/node", "between nodes"):
        table.add_column(col, no_wrap=col != "between nodes")
    for p in result.profiles:
        net = p.get("network")
        between = _link(p["inter_node_link"]) + (
            "" if not net else f", all-reduce {net['allreduce_bus_GBps']:.1f} GB/s"
            + (" as sampled" if net["how"] == "sampled" else " (link model)"))
        table.add_row(p["name"], p["gpu"].replace("NVIDIA ", ""), f"{p['gpu_memory_bytes'] / 2**30:.0f} GiB",
                      str(p["gpus_per_node"]), between)
    console.print(table)
    for p in result.profiles:
        samples = (f"samples of {p['base']} ({p['samples_gpu']}) transferred by a description"
                   if p.get("kind") == "description" else str(p["provenance"]).split(";")[0])
        net = p.get("network") or {}
        when = net.get("measured") or p.get("measured")
        console.print(f"  {p['name']}: {samples}" + (f"; measured {when}" if when else ""))
    console.print("Between nodes: the bus bandwidth of a 1 GiB all-reduce over two nodes, per GPU, as "
                  "the profile predicts it: a sampled profile predicts the network its samples ran on. "
                  "A description goes by its name from any directory; for your own nodes: "
                  f"{DESCRIBE_YOUR_NODES}. A description YAML works wherever a profile name does; `neox-perf clusters --gpus` lists the GPUs it can name, and "
                  "any other GPU is given by its data sheet's figures.")


def _render_gpus(rows, console) -> None:
    table = Table(title="GPUs a cluster description can name (dense rates, vendor data sheets)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("gpu", "memory", "HBM GB/s", "fp16 TF/s", "fp32 TF/s", "SMs", "MHz"):
        table.add_column(col, justify="left" if col == "gpu" else "right", no_wrap=True)
    for g in rows:
        table.add_row(g["name"], f"{g['memory_gib']:g} GiB {g['memory_type']}", _num(g["hbm_gbps"]),
                      _num(g["fp16_tflops"]), _num(g["fp32_tflops"]), _num(g["sms"]), _num(g["boost_mhz"]))
    console.print(table)
    console.print("fp16 is the dense fp16/bf16 tensor (AMD: matrix) core rate, fp32 the vector rate; "
                  "SMs are compute units on AMD. Sources:")
    for g in rows:
        console.print(f"  {g['name']}: {g['source']}" + (f"; {g['note']}" if g.get("note") else ""))
