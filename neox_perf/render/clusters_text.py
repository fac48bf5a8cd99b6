"""Text for `neox-perf clusters`."""
from __future__ import annotations

from rich.table import Table


def _link(link) -> str:
    return getattr(link, "name", None) or str(link)


def render(result, console) -> None:
    table = Table(title="Cluster profiles", title_justify="left")
    for col in ("name", "GPU", "memory", "GPUs/node", "links", "provenance"):
        table.add_column(col)
    for p in result.profiles:
        table.add_row(p["name"], p["gpu"], f"{p['gpu_memory_bytes'] / 2**30:.0f} GiB",
                      str(p["gpus_per_node"]), f"{_link(p['intra_node_link'])} / {_link(p['inter_node_link'])}",
                      str(p["provenance"]).split(";")[0])
    console.print(table)
