"""Loading a cluster profile: a bundled or user profile by name, a profile directory, or a
cluster description (`cluster.yml` in a profile directory, or any YAML file: cluster_file.py).

Above both kinds of profile: a sampled one (sampled.py: the trained regressors of one cluster)
or a description's (transfer.py: a sampled base profile's predictions transferred to the
described hardware). Loading never executes code: JSON, YAML safe_load and npz without pickle.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple, Union

from neox_perf.profile import directory as profile_dir
from neox_perf.profile.directory import bundled_dir, user_profiles_dir
from neox_perf.profile.sections import RETRAIN
from neox_perf.profile.values import ProfileInfo

from .artifacts import Arrays
from .cluster_file import DESCRIPTION_FILE, bundled_description, bundled_descriptions, is_description
from .errors import ProfileError
from .sampled import ClusterProfile, info_of

_LOADED: Dict[Tuple[str, int], ClusterProfile] = {}


def _resolve(name_or_path: Union[str, Path]) -> Path:
    """A profile directory (manifest.json or a cluster.yml description inside) or a
    description file."""
    text = str(name_or_path)
    if isinstance(name_or_path, str) and "/" not in text and "\\" not in text:
        # a bare name: bundled first, so a user profile can never shadow a published one; then
        # the bundled descriptions (neox_perf/examples/clusters/NAME.yml), from any directory
        if _present(bundled_dir() / text):
            return bundled_dir() / text
        described = bundled_description(text)
        if described is not None:
            return described
        if _present(user_profiles_dir() / text):
            return user_profiles_dir() / text
    path = Path(name_or_path).expanduser()
    if profile_dir.is_manifest(path):
        return path.parent
    if _present(path) or is_description(path):
        return path
    names = ", ".join(p.name for p in list_profiles()) or "none found"
    raise ProfileError(text, "no such cluster profile",
                       f"use a known profile ({names}), a profile directory, a cluster description "
                       f"YAML, or create one with `neox-perf calibrate --cluster {text}`")


def _present(path: Path) -> bool:
    """A directory there, or one a writer killed mid-swap left aside (put back first)."""
    if not path.is_dir() and path.parent.is_dir() and not profile_dir.is_bundled(path):
        profile_dir.recover_dir(path)
    return path.is_dir()


def load_profile(name_or_path: Union[str, Path]):
    """A bundled profile by name ("perlmutter-a100-80gb", "vista-gh200", the description
    "perlmutter-a100"), a profile directory, or a cluster description YAML file: a
    ClusterProfile, or for a description a TransferredProfile with the same interface."""
    target = _resolve(name_or_path).resolve()
    if target.is_dir() and not profile_dir.has_manifest(target) and (target / DESCRIPTION_FILE).is_file():
        return _load_description(target / DESCRIPTION_FILE, target)
    if target.is_file():
        return _load_description(target, target)
    return _load_sampled(target)


def _load_sampled(directory: Path) -> ClusterProfile:
    stamp = profile_dir.stamp(directory)
    hit = _LOADED.get((str(directory), stamp))
    if hit is not None:
        return hit
    manifest = profile_dir.read(directory)
    path = profile_dir.arrays_path(directory, manifest)
    arrays = None if path is None else Arrays(path, manifest.arrays.sha256)
    try:
        profile = ClusterProfile(directory, manifest, arrays)
    except (KeyError, TypeError, ValueError, IndexError) as exc:  # the manifest against its arrays
        raise ProfileError(profile_dir.manifest_path(directory),
                           f"inconsistent profile ({' '.join(str(exc).split())})", RETRAIN) from None
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
    if not (base_target.is_dir() and profile_dir.has_manifest(base_target)):
        raise ProfileError(file, f"base: {desc.base!r} is not a sampled profile (a description cannot be a base)",
                           "name the sampled profile that description is based on")
    base = _load_sampled(base_target)
    if desc.gpus_per_node > 1 and desc.intra_node_GBps is None:  # parse() already refuses this
        raise ProfileError(file, "intra_node_GBps: missing", "add intra_node_GBps")
    profile = transfer.TransferredProfile(desc, base, transfer.base_gpu_of(desc, base), path=path)
    _LOADED[(str(file), stamp)] = profile
    return profile


def list_profiles() -> List[ProfileInfo]:
    """Bundled profiles, the bundled cluster descriptions, then the user's
    (user_profiles_dir()) that a bundled name does not shadow; only those whose manifest (or
    cluster description) reads cleanly."""
    out: List[ProfileInfo] = []
    for root in (bundled_dir(), None, user_profiles_dir()):
        if root is None:
            for file in bundled_descriptions():
                if not any(info.name == file.stem for info in out):
                    try:
                        out.append(_description_info(file, name=file.stem))
                    except ProfileError:
                        continue
            continue
        if not root.is_dir():
            continue
        # dot-directories are writers' new versions and killed swaps' leftovers, not profiles
        for directory in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if any(info.name == directory.name for info in out):
                continue
            try:
                if profile_dir.has_manifest(directory):
                    out.append(info_of(directory, profile_dir.read(directory)))
                elif (directory / DESCRIPTION_FILE).is_file():
                    out.append(_description_info(directory / DESCRIPTION_FILE, directory))
            except ProfileError:
                continue
    return out


def _description_info(file: Path, path: Path = None, name: str = None) -> ProfileInfo:
    """A description's listing: `path` is what load_profile takes (its directory, or the
    file), `name` what --cluster takes (a bundled file's stem)."""
    from . import cluster_file
    desc = cluster_file.read(file)
    return ProfileInfo(name or desc.name, path or file, desc.gpu.name,
                       f"description: {desc.gpu.name} nodes, samples transferred from {desc.base}",
                       description=True)
