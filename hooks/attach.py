"""Wrapping deepspeed.initialize: the first engine it returns gets this process's Session.

activate.py calls patch_deepspeed when deepspeed is imported. The wrapper calls the original
initialize, then attaches one Session (session.py) per process to the engine; the Session
wraps the engine's methods (engine_patch.py). A failure here is reported once and training
goes on unhooked.
"""
from __future__ import annotations

import functools
import threading

from . import failures

_ATTR = "_neox_perf_wrapped"
_lock = threading.Lock()
_session = None


def patch_deepspeed(module) -> None:
    original = module.initialize
    if getattr(original, _ATTR, False):
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        result = original(*args, **kwargs)
        _attach(result, args, kwargs)
        return result

    setattr(initialize, _ATTR, True)
    initialize._neox_perf_original = original
    module.initialize = initialize


def _attach(result, args, kwargs) -> None:
    global _session
    try:
        engine = result[0] if isinstance(result, (tuple, list)) else result
        with _lock:
            if _session is None:
                from . import settings
                from .session import Session
                _session = Session(settings.read())
        if _session.engine is None:
            _session.attach(engine, args, kwargs)
        elif _session.engine is not engine:
            _session.note("a second deepspeed.initialize was not hooked (only the first engine is)")
    except Exception as exc:
        if _session is not None:
            _session.fail("attaching to the DeepSpeed engine", exc)
        else:
            failures.report_failure("attaching to the DeepSpeed engine", exc)


def current_session():
    return _session
