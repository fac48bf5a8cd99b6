"""Read and merge GPT-NeoX YAML files the way NeoXArgs.from_ymls does.

NeoX semantics reproduced here (megatron/neox_arguments/arguments.py):
- files merge in order; only top-level keys are normalised, `-` -> `_`;
- a key written identically in a later file raises in NeoX (its duplicate check compares
  the raw key against the already-normalised ones), while `train-iters` after
  `train_iters` silently overrides: we refuse the first and warn on the second;
- two files with the same base name are refused;
- a file name without `.yml`/`.json` gets `.yml` appended;
- an unknown key is refused: `NeoXArgs.from_ymls` ends in `cls(**config)`
  (megatron/neox_arguments/arguments.py:285), and a dataclass raises TypeError on a keyword it
  does not declare. build() reports it as an error verdict with a "did you mean".
`--set KEY=VALUE` overrides the merged files the way from_ymls applies `overwrite_values`
(arguments.py:279-281): after the merge, silently, one top-level key at a time.
NeoX reads with yaml.FullLoader; we use safe_load, which accepts every shipped config and
never constructs Python objects from a file.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import yaml

from ..errors import ConfigError
from .neox_keys import KEYS


@dataclass
class RawConfig:
    values: Dict[str, object] = field(default_factory=dict)  # normalised key -> value
    sources: Dict[str, str] = field(default_factory=dict)  # normalised key -> file that set it
    warnings: List[str] = field(default_factory=list)
    files: List[str] = field(default_factory=list)


def resolve_path(name: str, conf_dir: Optional[str] = None) -> str:
    if not (name.endswith(".yml") or name.endswith(".yaml") or name.endswith(".json")):
        # deepy.py appends .yml, so `125M` means `125M.yml`.
        if not os.path.exists(name if conf_dir is None else os.path.join(conf_dir, name)):
            name = name + ".yml"
    return name if conf_dir is None else os.path.join(conf_dir, name)


def _read_mapping(path: str, typed: Optional[str] = None) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        # named as the user typed it; the path deepy.py would also try, beside it
        also = f" (nor {path})" if typed and typed != path else ""
        raise ConfigError(f"no such file{also}", file=typed or path, fix="check the path")
    except IsADirectoryError:
        raise ConfigError("is a directory, not a YAML file", file=path, fix="name a .yml file")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc.__class__.__name__}", file=path,
                          fix="pass a readable UTF-8 YAML file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"not valid YAML ({where}{problem})", file=path,
                          fix="correct the YAML syntax at that position")
    except RecursionError:
        raise ConfigError("YAML nesting too deep", file=path, fix="flatten the file")
    if data is None:
        raise ConfigError("file is empty", file=path,
                          fix="NeoX needs a mapping of keys; remove the file or add keys")
    if not isinstance(data, dict):
        raise ConfigError(f"top level is a {type(data).__name__}, not a mapping of keys",
                          file=path, fix="write the config as `key: value` pairs")
    return data


def load_files(paths: Sequence[str], conf_dir: Optional[str] = None) -> RawConfig:
    if not paths:
        raise ConfigError("no config file given", fix="pass at least one NeoX .yml file")
    raw = RawConfig()
    basenames: Dict[str, str] = {}
    for name in paths:
        path = resolve_path(name, conf_dir)
        base = os.path.basename(path)
        if base in basenames:
            raise ConfigError(f"has the same file name as {basenames[base]}", file=path,
                              fix="NeoX saves configs by base name with the checkpoint; rename one")
        basenames[base] = path
        data = _read_mapping(path, name if conf_dir is None else os.path.join(conf_dir, name))
        raw.files.append(path)
        seen_here: Dict[str, str] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"key {key!r} is not a string", file=path,
                                  fix="quote the key or remove it")
            norm = key.replace("-", "_")
            if key in raw.values:
                raise ConfigError(
                    f"duplicates a key already set by {raw.sources[key]}", file=path, key=key,
                    fix="NeoX refuses the same key in two files; keep it in one of them")
            if norm in seen_here:
                raw.warnings.append(f"{path}: {seen_here[norm]!r} and {key!r} are the same key; "
                                    f"the later one wins")
            elif norm in raw.values:
                raw.warnings.append(f"{path}: {key!r} overrides the value from {raw.sources[norm]}")
            seen_here[norm] = key
            raw.values[norm] = value
            raw.sources[norm] = path
    for key, value in raw.values.items():
        if key in KEYS:
            _check_type(key, value, KEYS[key][0], raw.sources[key])
    return raw


SET_SOURCE = "--set"


def unknown_keys(raw: RawConfig) -> Dict[str, Optional[str]]:
    """Keys NeoX does not declare, each with the closest key it does (or None)."""
    out = {}
    for key in raw.values:
        if key not in KEYS:
            hint = difflib.get_close_matches(key, KEYS.keys(), n=1, cutoff=0.75)
            out[key] = hint[0] if hint else None
    return out


def apply_sets(raw: RawConfig, settings: Sequence[str]) -> RawConfig:
    """`--set KEY=VALUE` on the merged config: the value read as YAML (as in a file), `-` or `_`
    in the key alike, `a.b=v` setting one entry of a mapping key (NeoX then receives the
    whole mapping as the files have it, with that entry changed; `a.b.c=v` goes deeper). Types are checked as a
    file's are; an unknown key is left for build() to refuse like one in a file."""
    for item in settings or ():
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"{item!r} is not KEY=VALUE", file=SET_SOURCE,
                              fix="write e.g. --set train_micro_batch_size_per_gpu=4")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"the value of {item!r} is not valid YAML", file=SET_SOURCE, key=key,
                              fix="quote it or write it as in a config file") from None
        top, *path = key.split(".")
        if path:
            value = _set_nested(raw.values.get(top), path, value, key)
        if top in KEYS:
            _check_type(top, value, KEYS[top][0], SET_SOURCE)
        raw.values[top] = value
        raw.sources[top] = SET_SOURCE
    return raw


def _set_nested(current, path: List[str], value, key: str):
    """A copy of the mapping `current` with the entry at `path` set to `value`."""
    if current is not None and not isinstance(current, dict):
        raise ConfigError(f"{key} cannot be set: {'.'.join(key.split('.')[:-len(path)])} is not a "
                          f"mapping", file=SET_SOURCE, fix="set the whole value instead")
    out = dict(current or {})
    out[path[0]] = value if len(path) == 1 else _set_nested(out.get(path[0]), path[1:], value, key)
    return out


def _describe(spec) -> str:
    if isinstance(spec, tuple) and spec[0] == "choice":
        return "one of " + ", ".join(repr(v) for v in spec[1])
    if isinstance(spec, tuple) and spec[0] == "union":
        return " or ".join(_describe(s) for s in spec[1])
    return {"int": "an integer", "float": "a number", "bool": "true or false",
            "str": "a string", "list": "a list", "dict": "a mapping"}.get(spec, str(spec))


def _matches(value, spec) -> bool:
    # Mirrors NeoXArgs.validate_types: exact types, ints accepted for floats, Literal
    # choices compared case-insensitively, None always allowed.
    if value is None or spec == "any":
        return True
    if isinstance(spec, tuple):
        kind, options = spec
        if kind == "choice":
            if value in options:
                return True
            return isinstance(value, str) and value.lower() in [o.lower() for o in options
                                                                if isinstance(o, str)]
        return any(_matches(value, s) for s in options)
    expected = {"int": int, "float": float, "bool": bool, "str": str, "list": list,
                "dict": dict}[spec]
    if type(value) is expected:
        return True
    return spec == "float" and type(value) is int


def _check_type(key: str, value, spec, source: str) -> None:
    if not _matches(value, spec):
        shown = repr(value)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        raise ConfigError(f"value {shown} is not {_describe(spec)}", file=source, key=key,
                          fix=f"set {key} to {_describe(spec)}")
