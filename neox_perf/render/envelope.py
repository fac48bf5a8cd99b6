"""The versioned --json envelope every command prints.

`schema` names the command and the major version of its payload; a contract test pins the
keys, and any change that removes or renames a key must bump the version.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict

from .. import __version__

SCHEMA_VERSION = 1


def envelope(command: str, exit_code: int, payload: Dict[str, Any]) -> Dict[str, Any]:
    return {"schema": f"neox-perf/{command}/v{SCHEMA_VERSION}", "neox_perf_version": __version__,
            "command": command, "exit_code": exit_code, **payload}


def error_envelope(command: str, line: str, exit_code: int) -> Dict[str, Any]:
    return envelope(command, exit_code, {"error": {"message": line}})


def _clean(value):
    # JSON has no NaN/inf; a prediction that could not be made is null, never a fake number.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _clean(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dump(data: Dict[str, Any]) -> str:
    return json.dumps(_clean(data), indent=2, sort_keys=False)
