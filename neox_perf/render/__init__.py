"""The only layer that prints: rich text for people, one JSON envelope for machines."""
from __future__ import annotations

import importlib
import sys


def emit(result, want_json: bool, line: bool = False) -> None:
    if line:  # one plain line (a job script's log, a CI step): no rich, no colour
        module = importlib.import_module(f".{result.render_hint.replace('_text', '_line')}", __name__)
        sys.stdout.write(module.line(result) + "\n")
        return
    if want_json:
        from .envelope import dump, envelope
        sys.stdout.write(dump(envelope(result.command, result.exit_code, result.to_dict(),
                                       getattr(result, "schema", None))) + "\n")
        return
    from rich.console import Console
    # Each result names the module under render/ that draws it, so results stay free of rich.
    module = importlib.import_module(f".{result.render_hint}", __name__)
    module.render(result, Console(highlight=False))
