"""neox-perf's sitecustomize: on PYTHONPATH of every rank `neox-perf run` launches.

Python imports the first `sitecustomize` on sys.path at start-up, so ours shadows any other
(a site-wide one, or one on the user's PYTHONPATH): after doing our part we run the next one
so the user's start-up code still runs. Our part is tiny and never imports torch: if the
switch variable is set, install an import hook that patches deepspeed when (if ever) it is
imported. Launchers, compilers and helper processes pay only this check.
"""


def _neox_perf():
    import os
    if not os.environ.get("PYTHON_NEOX_PERF_RUN_DIR", "").strip():
        return
    try:
        from neox_perf.hooks import activate
        activate.install()
    except Exception as exc:  # never stop Python from starting
        import sys
        sys.stderr.write(f"neox-perf: hook not installed ({exc.__class__.__name__}: {exc})\n")


def _chain():
    import importlib.machinery
    import importlib.util
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # as if it had been the one Python found
    spec.loader.exec_module(module)


_neox_perf()
try:
    _chain()
finally:
    del _neox_perf, _chain
