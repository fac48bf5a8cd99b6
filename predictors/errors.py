"""Errors of the predictors: one line each, naming the file and how to fix it."""
from __future__ import annotations

from neox_perf.errors import NeoxPerfError, ProfileError  # noqa: F401 (a predictor error too)


class SampleFileError(NeoxPerfError):
    """A sample CSV is unreadable or malformed (bad header, text in a number, empty)."""

    def __init__(self, path, problem: str, line: int | None = None):
        self.path = str(path)
        self.problem = problem
        self.line_no = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(" ".join(f"{where}: {problem}".split()))
