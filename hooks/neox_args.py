"""Where the NeoX config of a running job comes from, as plain JSON-able values.

In order:
1. GPT-NeoX: `deepspeed.initialize(args=neox_args, ...)` (megatron/training.py) hands us the
   NeoXArgs object: every key, defaults included, plus the runtime `padded_vocab_size`.
   If it was not passed, `megatron.neox_arguments` may still hold it on a loaded module.
   Failing that, the `--megatron_config` deepy.py hands every rank (base64 JSON of the
   merged YAML after NeoX's own derivations: the same values NeoXArgs is built from).
2. The switch's PYTHON_NEOX_PERF_CONFIG files (+ PYTHON_NEOX_PERF_VOCAB): any script.
3. neox-perf's reference workload (`-m neox_perf.calibration.workload.train --config ...`):
   its own command line.
Otherwise there is no model config; the hook still times iterations and maps operators.

The result is `{"source", "values" (normalised NeoX keys), "files", "vocab", "vocab_padded"}`;
report.py rebuilds a NeoxConfig from it with the project's loader, offline.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

WORKLOAD_MODULE = "neox_perf.calibration.workload.train"


def _jsonable(value, depth: int = 0):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 6:
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    return None  # tensors, tokenizers, groups: not config


def from_neox_args(neox_args) -> Optional[Dict[str, Any]]:
    """Values of a NeoXArgs-like object for every key the project's loader knows."""
    from neox_perf.config.neox_keys import KEYS
    if neox_args is None or not hasattr(neox_args, "hidden_size") or not hasattr(neox_args, "num_layers"):
        return None
    values = {}
    for key in KEYS:
        if hasattr(neox_args, key):
            v = getattr(neox_args, key)
            if v is not None:
                values[key] = _jsonable(v)
    padded = getattr(neox_args, "padded_vocab_size", None)
    return {"source": "GPT-NeoX args passed to deepspeed.initialize", "values": values, "files": [],
            "vocab": int(padded) if padded else None, "vocab_padded": bool(padded)}


def _from_megatron() -> Optional[Dict[str, Any]]:
    # NeoX keeps no global args object; look only at modules already loaded, never import.
    for name in ("megatron.neox_arguments", "megatron.training", "megatron.global_vars"):
        module = sys.modules.get(name)
        for attr in ("_GLOBAL_ARGS", "neox_args", "args"):
            found = from_neox_args(getattr(module, attr, None)) if module else None
            if found:
                found["source"] = f"{name}.{attr}"
                return found
    return None


MEGATRON_CONFIG = "--megatron_config"
# CharLevelTokenizer's size in NeoX's build_tokenizer; other tokenizers' sizes come from files
_FIXED_VOCAB = {"CharLevelTokenizer": 512}


def megatron_config_arg(argv: List[str]) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == MEGATRON_CONFIG and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(MEGATRON_CONFIG + "="):
            return a.split("=", 1)[1]
    return None


def from_megatron_config(encoded: str) -> Optional[Dict[str, Any]]:
    """The values of deepy.py's `--megatron_config` (what NeoXArgs.consume_neox_args reads)."""
    import base64
    import json
    try:
        values = json.loads(base64.urlsafe_b64decode(encoded).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(values, dict):
        return None
    from neox_perf.config.neox_keys import KEYS
    kept = {k: _jsonable(v) for k, v in values.items() if k in KEYS and v is not None}
    if "hidden_size" not in kept or "num_layers" not in kept:
        return None
    padded = kept.pop("padded_vocab_size", None)
    raw = _FIXED_VOCAB.get(str(kept.get("tokenizer_type")))
    return {"source": "GPT-NeoX --megatron_config (deepy.py)", "values": kept,
            "files": sorted((values.get("config_files") or {}).keys()),
            "vocab": int(padded) if padded else raw, "vocab_padded": bool(padded)}


def _from_argv() -> Optional[Dict[str, Any]]:
    encoded = megatron_config_arg(sys.argv)
    return from_megatron_config(encoded) if encoded else None


def from_files(files: List[str], vocab: Optional[int], source: str) -> Dict[str, Any]:
    from neox_perf.config import load_files
    raw = load_files(list(files))
    return {"source": source, "values": _jsonable(raw.values), "files": list(raw.files),
            "vocab": vocab, "vocab_padded": False}


def _workload_argv() -> Optional[Dict[str, Any]]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if getattr(spec, "name", None) != WORKLOAD_MODULE:
        return None
    from neox_perf.calibration.workload.train import parse_args
    try:
        args = parse_args(sys.argv[1:])
    except SystemExit:
        return None
    return from_files(args.config, args.vocab_size, "reference workload command line")


def discover(init_args, settings) -> Dict[str, Any]:
    """The job's config, or {"source": None, "why": ...} when there is none."""
    tried = []
    found = from_neox_args(init_args)
    if found:
        return found
    found = _from_megatron() or _from_argv()
    if found:
        return found
    if settings.config_files:
        return from_files(settings.config_files, settings.vocab, "PYTHON_NEOX_PERF_CONFIG files")
    tried.append("no NeoXArgs passed to deepspeed.initialize")
    found = _workload_argv()
    if found:
        return found
    tried.append("not GPT-NeoX or the reference workload, and no PYTHON_NEOX_PERF_CONFIG "
                 "(neox-perf run --neox-config FILE)")
    return {"source": None, "values": None, "files": [], "vocab": None, "vocab_padded": False,
            "why": "; ".join(tried)}
