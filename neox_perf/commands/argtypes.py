"""Argument types shared by the CLI's parsers: each names what it wants in its one-line error."""
from __future__ import annotations

import argparse
from typing import Callable, List


def _number(text: str, cast: Callable, ok: Callable, must: str):
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {'whole number' if cast is int else 'number'}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be {must}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "at least 1")


def count(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "a whole number >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "positive")


def fraction(text: str) -> float:
    return _number(text, float, lambda v: 0 < v <= 1, "above 0 and at most 1 (e.g. 0.9)")


def gpu_counts(text: str) -> List[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a GPU count or a comma-separated "
                                             f"list of them (e.g. 64,96,128)")
        out.append(int(part))
    return out
