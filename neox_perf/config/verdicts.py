"""A verdict is one finding about a config: what, how bad, where, and the fix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# "error": NeoX/DeepSpeed would refuse the config (exit 1).
# "fail": the config is valid but will not work as wanted: out of memory, too slow (exit 3).
# "warning": worth a look, nothing breaks.  "ok": a check that passed, shown for context.
LEVELS = ("ok", "warning", "fail", "error")


@dataclass(frozen=True)
class Verdict:
    code: str  # stable identifier, e.g. "heads_divisible_by_mp"
    level: str  # one of LEVELS
    message: str  # one line for the user
    key: Optional[str] = None  # config key it concerns
    file: Optional[str] = None  # file that set that key, if any
    fix: Optional[str] = None  # what to change

    def line(self) -> str:
        where = ": ".join(p for p in (self.file, self.key) if p)
        text = f"{where}: {self.message}" if where else self.message
        return f"{text} (fix: {self.fix})" if self.fix else text
