"""Switching the hook on inside a process: patch deepspeed when it is imported.

    python -m neox_perf.hooks.activate --run-dir DIR [--cluster NAME]   # prints `export` lines

`install()` is what our sitecustomize calls. It adds a `sys.meta_path` finder that waits
for `import deepspeed`, lets the real import run, then wraps `deepspeed.initialize`
(attach). If deepspeed is already imported it patches at once. No torch import here:
every Python process started with the switch (launchers, compilers) runs this.
"""
from __future__ import annotations

import importlib.abc
import shlex
import sys
import threading
from typing import Optional

_TARGET = "deepspeed"
_lock = threading.Lock()
_installed = False


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it filled."""

    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        try:
            self.real.exec_module(module)
        finally:
            # Leave no trace: deepspeed's own code sees its usual loader.
            module.__loader__ = self.real
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self.real
        _patch(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.real, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        # Ask the remaining finders; we only want to be told when the real module runs.
        try:
            sys.meta_path.remove(self)
        except ValueError:
            return None
        try:
            import importlib.util
            spec = importlib.util.find_spec(fullname)
        except Exception:
            return None  # let the normal import machinery find (or fail to find) it
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def _patch(module) -> None:
    try:
        from . import attach
        attach.patch_deepspeed(module)
    except Exception as exc:  # the import itself must succeed whatever happens here
        from .failures import report_failure
        report_failure("patching deepspeed", exc)


def install() -> bool:
    """Idempotent. True if deepspeed will be (or was) patched."""
    global _installed
    with _lock:
        if _installed:
            return True
        _installed = True
        module = sys.modules.get(_TARGET)
        if module is not None and hasattr(module, "initialize"):
            _patch(module)
        else:
            sys.meta_path.insert(0, _Finder())
        return True


def main(argv: Optional[list] = None) -> int:
    import argparse

    from . import settings
    p = argparse.ArgumentParser(prog="python -m neox_perf.hooks.activate",
                                description="Print the environment that switches the neox-perf "
                                            "hook on for every rank of a launch command.")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--cluster")
    p.add_argument("--windows")
    args = p.parse_args(argv)
    env = settings.environment(args.run_dir, cluster=args.cluster, windows=args.windows)
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
