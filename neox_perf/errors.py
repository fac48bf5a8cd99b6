"""Errors that reach the user as one line: where, what, and how to fix it."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional


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


class ProfileError(PathError):
    """A cluster profile is missing, corrupt, or not a neox-perf profile: the file (or the
    file and the manifest key) that is wrong, what is wrong with it, and the fix."""


@contextmanager
def reading(where: str, fix: str) -> Iterator[None]:
    """Whatever goes wrong reading the value at ``where`` (a file and the key inside it)
    becomes one ProfileError line naming it; errors that already name their key pass."""
    try:
        yield
    except ProfileError:
        raise
    except KeyError as exc:
        raise ProfileError(where, f"missing key {exc}", fix) from None
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ProfileError(where, f"cannot be read ({exc.__class__.__name__}: {exc})", fix) from None


def text(value) -> str:
    """``value``, which must be a string (a manifest's text field, read under ``reading``)."""
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value


class UsageError(NeoxPerfError):
    """The command line itself is wrong (missing file, bad flag value)."""
