"""The versioned --json envelope every command prints.

`schema` names the payload (the command's, or its own where one command prints two) and
its major version; a contract test pins the keys, and any change that removes or renames a
key must bump that payload's version.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, Optional

from .. import __version__

# The major version of each payload, by schema name: a command's name, or its own name where
# one command prints two payloads (`calibrate --from-run` is not `calibrate`'s payload).
SCHEMA_VERSIONS = {"check": 1, "plan": 1, "clusters": 1, "calibrate": 1,
                   "calibrate-from-run": 1, "validate": 1, "run": 1, "report": 1,
                   "report-neox-log": 1}


def schema(name: str) -> str:
    return f"neox-perf/{name}/v{SCHEMA_VERSIONS.get(name, 1)}"


def envelope(command: str, exit_code: int, payload: Dict[str, Any],
             schema_name: Optional[str] = None) -> Dict[str, Any]:
    return {"schema": schema(schema_name or command), "neox_perf_version": __version__,
            "command": command, "exit_code": exit_code, **payload}


def error_envelope(command: str, line: str, exit_code: int,
                   schema_name: Optional[str] = None) -> Dict[str, Any]:
    return envelope(command, exit_code, {"error": {"message": line}}, schema_name)


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
