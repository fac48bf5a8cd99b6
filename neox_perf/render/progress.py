"""Progress bars for long commands: a rich Progress on stderr driven by the command's callback.

Commands never import rich; they take ``progress(step, done, total, label)`` (calibrate) or
``progress(done, total, label)`` (validate) and call it as they go. ``bars()`` returns such a
callback and keeps one bar per step; with ``enabled=False`` (``--json``, or stderr not a
terminal) it returns None and the command runs silently.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional


def wanted(want_json: bool) -> bool:
    return not want_json and sys.stderr.isatty()


@contextmanager
def bars(enabled: bool = True, console=None) -> Iterator[Optional[Callable[..., None]]]:
    """Yields progress(step, done, total, label); progress(done, total, label) uses one bar."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    progress = Progress(TextColumn("[bold]{task.fields[step]:<12}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                        TextColumn("{task.description}"),
                        console=console or Console(stderr=True), transient=False)
    tasks: Dict[str, int] = {}

    def update(*args) -> None:
        step, (done, total, label) = (args[0], args[1:]) if len(args) == 4 else ("", args)
        if step not in tasks:
            tasks[step] = progress.add_task(str(label), total=max(float(total), 1.0), step=step)
        progress.update(tasks[step], completed=float(done), total=max(float(total), 1.0),
                        description=_short(str(label)))

    with progress:
        yield update


def _short(label: str, width: int = 48) -> str:
    return label if len(label) <= width else label[:width - 1] + "…"
