"""Errors that reach the user as one line: where, what, and how to fix it."""
from __future__ import annotations

from typing import Optional


class NeoxPerfError(Exception):
    """Base for every error the CLI turns into one line and an exit code."""

    def line(self) -> str:
        return str(self)


class ConfigError(NeoxPerfError):
    """The config (or its files) is something NeoX/DeepSpeed would refuse or we cannot read."""

    def __init__(self, problem: str, *, file: Optional[str] = None, key: Optional[str] = None,
                 fix: Optional[str] = None):
        self.problem = problem
        self.file = file
        self.key = key
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        where = ": ".join(p for p in (self.file, self.key) if p)
        text = f"{where}: {self.problem}" if where else self.problem
        if self.fix:
            text += f" (fix: {self.fix})"
        # One line, always: YAML error messages carry their own newlines.
        return " ".join(text.split())


class PathError(NeoxPerfError):
    """A file or directory that cannot be used: one line with the path, the problem and the fix."""

    def __init__(self, path, problem: str, fix: str):
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(" ".join(f"{self.path}: {problem} (fix: {fix})".split()))


class UsageError(NeoxPerfError):
    """The command line itself is wrong (missing file, bad flag value)."""
