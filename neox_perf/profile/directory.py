"""The one reader and writer of a cluster profile directory.

A sampled profile is a directory holding manifest.json (neox_perf/profile/manifest.Manifest)
and, when its models have trees, the arrays file the manifest names (arrays.npz). Nothing
else in the package opens these files by name (tests/test_profile_writes.py checks): the
loader reads through `read`, and every writer -- training, `neox-perf calibrate`, its engine
fit, `validate`'s record, `calibrate --from-run`, benchmarks/endtoend.py --write-terms --
writes through `replacing`, `write` and `update`.

Nothing is written in place. `replacing(final)` gives an empty directory beside `final` (the
same file system) to `write` the new version into, and swaps it in whole when the block ends:
one renameat2(RENAME_EXCHANGE) on Linux, else two renames, a kill between which leaves the old
version aside where `recover_dir` (run by every writer, and by the loader when a profile is
missing) puts it back. A failure or a kill at any moment leaves the old profile or the new one
whole, never a mix of their files.

A writer may be handed a directory `replacing` gave out and has not swapped in yet (a refit
builds its new version with the helpers that write a profile, then records more in it): that
version is read by nobody, so `update` changes it in place, and a `replacing` of it names its
own temporary directory after the profile both will replace, where `recover_dir` finds it.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from ..errors import ProfileError
from .manifest import Manifest
from .sections import RETRAIN, ArraysRef

MANIFEST_FILE = "manifest.json"
ARRAYS_FILE = "arrays.npz"


def bundled_dir() -> Path:
    """The profiles this package ships: neox_perf/profiles, installed or in the source tree."""
    return Path(__file__).resolve().parents[1] / "profiles"


def bundled_descriptions_dir() -> Path:
    """The cluster descriptions this package ships (neox_perf/examples/clusters/NAME.yml): a
    bare `--cluster NAME` finds them after the bundled profiles, from any directory."""
    return Path(__file__).resolve().parents[1] / "examples" / "clusters"


def is_bundled(path) -> bool:
    """Whether a profile directory is one this package ships (read-only: never written)."""
    return Path(path).resolve().parent == bundled_dir().resolve()


def user_profiles_dir() -> Path:
    """Where `neox-perf calibrate` writes profiles: $NEOX_PERF_HOME/profiles, by default
    ~/.cache/neox-perf/profiles. Read at every call, so a changed variable takes effect."""
    home = os.environ.get("NEOX_PERF_HOME")
    return (Path(home) if home else Path("~/.cache/neox-perf")).expanduser() / "profiles"


# -- reading -----------------------------------------------------------------------------------

def has_manifest(directory) -> bool:
    """Whether ``directory`` is a sampled profile's (it holds a manifest)."""
    return (Path(directory) / MANIFEST_FILE).is_file()


def is_manifest(path) -> bool:
    """Whether ``path`` names a profile's manifest file itself."""
    return Path(path).name == MANIFEST_FILE and Path(path).is_file()


def manifest_path(directory) -> Path:
    """The manifest's path, for messages that name it."""
    return Path(directory) / MANIFEST_FILE


def stamp(directory) -> int:
    """When the profile in ``directory`` was last written (0: none there): a new version is
    a new manifest file, so a loader can cache by it."""
    try:
        return (Path(directory) / MANIFEST_FILE).stat().st_mtime_ns
    except OSError:
        return 0


def read(directory) -> Manifest:
    """The manifest of the profile in ``directory``; a missing, unreadable or malformed one
    is one ProfileError line naming the file (and the key) and the fix."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise ProfileError(path, "profile manifest not found", f"point at a profile directory or {RETRAIN}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(path, f"unreadable profile manifest ({exc})", RETRAIN) from None
    return Manifest.parse(data, str(path))


def arrays_path(directory, manifest: Manifest) -> Optional[Path]:
    """The arrays file the manifest names (None: a profile without trees); a missing file is
    one ProfileError line."""
    if manifest.arrays is None or not manifest.arrays.file:
        return None
    path = Path(directory) / manifest.arrays.file
    if not path.is_file():
        raise ProfileError(path, "profile arrays file not found", RETRAIN)
    return path


# -- writing -----------------------------------------------------------------------------------

def write(directory, manifest: Manifest, arrays: Optional[Mapping[str, object]] = None,
          arrays_from=None) -> Manifest:
    """Write a profile into ``directory``, a fresh one nobody reads yet (``replacing``'s):
    the arrays first -- ``arrays`` (member name -> numpy array) saved, or the file of the
    profile directory ``arrays_from`` carried over, or (neither) the ones written there before
    -- then the manifest naming them and their checksum. Returns the manifest as written."""
    directory = Path(directory)
    if arrays is not None:
        import numpy as np
        target = directory / ARRAYS_FILE
        with open(target, "wb") as fh:
            # stored, not deflated: `check` reads some thirty forests on every start, and
            # inflating them cost it ~50 ms; the wheel deflates the file anyway
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        manifest = replace(manifest, arrays=replace(manifest.arrays or ArraysRef(), file=ARRAYS_FILE,
                                                    sha256=sha256_of(target)))
    elif arrays_from is not None and manifest.arrays is not None and manifest.arrays.file:
        _carry(Path(arrays_from) / manifest.arrays.file, directory / manifest.arrays.file)
    data = json.dumps(manifest.to_dict(), indent=1, allow_nan=False) + "\n"  # NaN: ValueError
    with open(directory / MANIFEST_FILE, "w", encoding="utf-8") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return manifest


# The directories `replacing` has given out and not swapped in yet -> the profile each replaces.
_PENDING: dict = {}


def _pending(directory) -> Optional[Path]:
    return _PENDING.get(Path(directory).resolve())


@contextmanager
def replacing(final) -> Iterator[Path]:
    """An empty directory beside ``final`` to write a new version of that profile into; when
    the block ends it replaces ``final`` whole, in one step. An exception (or a kill) in the
    block leaves ``final`` as it was and the new version is removed (by the next writer after
    a kill)."""
    final = Path(final)
    profile = _pending(final) or final  # ``final`` may itself be a version not swapped in yet
    recover_dir(profile)
    tmp = temp_dir_for(final, profile.name)
    _PENDING[tmp.resolve()] = profile
    try:
        yield tmp
        _fsync_dir(tmp)
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _PENDING.pop(tmp.resolve(), None)


def update(directory, change: Callable[[Manifest], Manifest]) -> Manifest:
    """A new version of the profile in ``directory``: its manifest changed by ``change``, every
    other file carried over as it is, swapped in whole (in place where ``directory`` is a version
    `replacing` has not swapped in yet: nobody reads it). Returns the manifest written."""
    directory = Path(directory)
    if _pending(directory) is not None:
        return write(directory, change(read(directory)))
    with replacing(directory) as tmp:
        manifest = change(read(directory))
        for entry in directory.iterdir():
            if entry.name != MANIFEST_FILE and entry.is_file():
                _carry(entry, tmp / entry.name)
        return write(tmp, manifest)


def _carry(src: Path, dst: Path) -> None:
    """``src`` at ``dst`` too: a hard link (files are replaced, never changed in place), a copy
    where the file system has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def sha256_of(path) -> str:
    """The file's SHA-256 (the arrays file's, which the manifest records; the trainers' sample
    files' and stores')."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- the swap ----------------------------------------------------------------------------------

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_dir(final: Path) -> None:
    """Undo what a killed replace_dir left next to `final`: the previous profile moved aside
    (put back when `final` is missing) and temporary directories of dead processes."""
    final = Path(final)
    parent = final.parent
    if not parent.is_dir():
        return
    for kind in ("old", "tmp"):
        for path in sorted(parent.glob(f".{final.name}.{kind}-*")):
            try:
                pid = int(path.name[len(f".{final.name}.{kind}-"):].split("-")[0])
            except ValueError:
                continue
            if _pid_alive(pid):  # still writing (this process included)
                continue
            if kind == "old" and not final.exists():
                os.rename(path, final)
            else:
                shutil.rmtree(path, ignore_errors=True)


def temp_dir_for(final: Path, name: Optional[str] = None) -> Path:
    """An empty directory beside `final` (same file system, so it can be renamed onto it),
    named for the profile ``name`` (default `final`'s) so that `recover_dir` finds it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name or final.name}.tmp-{os.getpid()}-", dir=str(final.parent)))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the profile from a shared group
    return tmp


def replace_dir(new: Path, final: Path) -> None:
    """Put the finished directory `new` at `final`, replacing what was there in one step."""
    new, final = Path(new), Path(final)
    if not final.exists():
        os.rename(new, final)
    elif _exchange(new, final):  # `new` now holds the previous profile
        shutil.rmtree(new, ignore_errors=True)
    else:
        # Two renames: a kill between them leaves the previous profile at `old`, where
        # recover_dir (run before every write) puts it back.
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        try:
            os.rename(new, final)
        except BaseException:
            os.rename(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)
