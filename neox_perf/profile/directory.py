"""Writing a profile directory in one step.

Profiles are written to a temporary sibling directory and swapped into place (replace_dir):
a crash at any moment leaves either the old profile or the new one, never a mix of their
files; recover_dir undoes what a killed swap left behind.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict

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


def write_manifest(path: Path, manifest: Dict[str, Any]) -> None:
    """A manifest inside a temporary profile directory: nobody reads it before the swap, so
    a plain write (mode per umask, unlike a mkstemp file's 0600) is enough."""
    import json
    Path(path).write_text(json.dumps(manifest, indent=1, allow_nan=False) + "\n")


def temp_dir_for(final: Path) -> Path:
    """An empty directory beside `final` (same file system, so it can be renamed onto it)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=str(final.parent)))
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
