"""Loading a cluster profile: a bundled or user profile by name, a profile directory, or a
cluster description (`cluster.yml` in a profile directory, or any YAML file: cluster_file.py).

Above both kinds of profile: a sampled one (sampled.py: the trained regressors of one cluster)
or a description's (transfer.py: a sampled base profile's predictions transferred to the
described hardware). Loading never executes code: JSON, YAML safe_load and npz without pickle.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from neox_perf.profile.values import ProfileInfo

from .artifacts import MANIFEST_FILE, RETRAIN, SCHEMA, SCHEMA_VERSION, Arrays
from .cluster_file import DESCRIPTION_FILE, is_description
from .errors import ProfileError
from .sampled import ClusterProfile, info_of


def _bundled_dir() -> Path:
    # installed: neox_perf/profiles next to neox_perf/__init__.py; source tree: the same folder
    import neox_perf
    return Path(neox_perf.__file__).resolve().parent / "profiles"


def is_bundled(path) -> bool:
    """Whether a profile directory is one this package ships (read-only: never written)."""
    return Path(path).resolve().parent == _bundled_dir().resolve()


def user_profiles_dir() -> Path:
    """Where `neox-perf calibrate` writes profiles: $NEOX_PERF_HOME/profiles, by default
    ~/.cache/neox-perf/profiles. Read at every call, so a changed variable takes effect."""
    home = os.environ.get("NEOX_PERF_HOME")
    return (Path(home) if home else Path("~/.cache/neox-perf")).expanduser() / "profiles"



def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise ProfileError(path, "profile manifest not found", f"point at a profile directory or {RETRAIN}")
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(path, f"unreadable profile manifest ({exc})", RETRAIN) from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise ProfileError(path, "not a neox-perf cluster profile (no schema "
                                 f"{SCHEMA!r})", "point at a directory written by neox_perf.predictors.fitting.train")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(path, f"profile schema version {version!r}, this neox-perf reads {SCHEMA_VERSION}",
                           f"use the neox-perf that wrote it or {RETRAIN}")
    for key in ("name", "facts", "operators", "collectives"):
        if key not in manifest:
            raise ProfileError(path, f"profile manifest lacks {key!r}", RETRAIN)
    return manifest


def _read_arrays(directory: Path, manifest: dict) -> Optional[Arrays]:
    spec = manifest.get("arrays") or {}
    if not spec.get("file"):
        return None
    path = directory / spec["file"]
    if not path.is_file():
        raise ProfileError(path, "profile arrays file not found", RETRAIN)
    return Arrays(path, spec.get("sha256"))


_LOADED: Dict[Tuple[str, int], ClusterProfile] = {}


def _is_profile_dir(path: Path) -> bool:
    return (path / MANIFEST_FILE).is_file() or (path / DESCRIPTION_FILE).is_file()


def _resolve(name_or_path: Union[str, Path]) -> Path:
    """A profile directory (manifest.json or a cluster.yml description inside) or a
    description file."""
    text = str(name_or_path)
    bundled = _bundled_dir()
    if isinstance(name_or_path, str) and "/" not in text and "\\" not in text:
        # a bare name: bundled first, so a user profile can never shadow a published one
        for root in (bundled, user_profiles_dir()):
            if (root / text).is_dir():
                return root / text
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.name == MANIFEST_FILE:
        return path.parent
    if path.is_dir() or is_description(path):
        return path
    names = ", ".join(p.name for p in list_profiles()) or "none found"
    raise ProfileError(text, "no such cluster profile",
                       f"use a known profile ({names}), a profile directory, a cluster description "
                       f"YAML, or create one with `neox-perf calibrate --cluster {text}`")


def load_profile(name_or_path: Union[str, Path]):
    """A bundled profile by name ("perlmutter-a100-80gb", "vista-gh200", the description
    "perlmutter-a100"), a profile directory, or a cluster description YAML file: a
    ClusterProfile, or for a description a TransferredProfile with the same interface."""
    target = _resolve(name_or_path).resolve()
    if target.is_dir() and not (target / MANIFEST_FILE).is_file() and (target / DESCRIPTION_FILE).is_file():
        return _load_description(target / DESCRIPTION_FILE, target)
    if target.is_file():
        return _load_description(target, target)
    return _load_sampled(target)


def _load_sampled(directory: Path) -> ClusterProfile:
    manifest_path = directory / MANIFEST_FILE
    stamp = manifest_path.stat().st_mtime_ns if manifest_path.is_file() else 0
    hit = _LOADED.get((str(directory), stamp))
    if hit is not None:
        return hit
    manifest = _read_manifest(directory)
    arrays = _read_arrays(directory, manifest)
    try:
        profile = ClusterProfile(directory, manifest, arrays)
    except KeyError as exc:
        raise ProfileError(manifest_path, f"inconsistent profile (missing key {exc})", RETRAIN) from None
    except (TypeError, ValueError, IndexError) as exc:
        raise ProfileError(manifest_path, f"inconsistent profile ({' '.join(str(exc).split())})", RETRAIN) from None
    _LOADED[(str(directory), stamp)] = profile
    return profile


def _load_description(file: Path, path: Path):
    from . import cluster_file, transfer
    stamp = file.stat().st_mtime_ns if file.is_file() else 0
    hit = _LOADED.get((str(file), stamp))
    if hit is not None:
        return hit
    desc = cluster_file.read(file)
    base_ref = desc.base_path()
    try:
        base_target = _resolve(base_ref).resolve()
    except ProfileError:
        names = ", ".join(p.name for p in list_profiles() if not p.description) or "none found"
        raise ProfileError(file, f"base: no sampled profile {desc.base!r}",
                           f"use a sampled profile ({names}) or a profile directory") from None
    if not (base_target.is_dir() and (base_target / MANIFEST_FILE).is_file()):
        raise ProfileError(file, f"base: {desc.base!r} is not a sampled profile (a description cannot be a base)",
                           "name the sampled profile that description is based on")
    base = _load_sampled(base_target)
    if desc.gpus_per_node > 1 and desc.intra_node_GBps is None:  # parse() already refuses this
        raise ProfileError(file, "intra_node_GBps: missing", "add intra_node_GBps")
    profile = transfer.TransferredProfile(desc, base, transfer.base_gpu_of(desc, base), path=path)
    _LOADED[(str(file), stamp)] = profile
    return profile


def list_profiles() -> List[ProfileInfo]:
    """Bundled profiles, then the user's (user_profiles_dir()) that a bundled name does not
    shadow; only those whose manifest (or cluster description) reads cleanly."""
    out: List[ProfileInfo] = []
    for root in (_bundled_dir(), user_profiles_dir()):
        if not root.is_dir():
            continue
        for directory in sorted(p for p in root.iterdir() if p.is_dir()):
            if any(info.name == directory.name for info in out):
                continue
            try:
                if (directory / MANIFEST_FILE).is_file():
                    out.append(info_of(directory, _read_manifest(directory)))
                elif (directory / DESCRIPTION_FILE).is_file():
                    out.append(_description_info(directory))
            except ProfileError:
                continue
    return out


def _description_info(directory: Path) -> ProfileInfo:
    from . import cluster_file
    desc = cluster_file.read(directory / DESCRIPTION_FILE)
    return ProfileInfo(desc.name, directory, desc.gpu.name,
                       f"description: {desc.gpu.name} nodes, samples transferred from {desc.base}",
                       description=True)
