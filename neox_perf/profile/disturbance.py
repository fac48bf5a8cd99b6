"""Whether the calibration a profile was fitted from was disturbed, and the warning every
report made with it carries (docs/calibration-disturbance.md).

`neox-perf calibrate` times a fixed reference at its start, along the way and at its end,
watches the machine, flags in the sample store the samples timed while the machine was
disturbed and re-times what it can (calibration/disturbance.py). When the profile is fitted,
``from_calibration`` turns the store's record into this section: how many of the fitted
operator samples are still flagged, what the reference and the machine showed, and one warning
line. ``profile_warnings`` gives that line to check, plan, validate, report and
`calibrate --from-run`, for the profile and for the sampled profile a description stands on.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence

from ..errors import reading, text
from .sections import RETRAIN, _optional, _typed, _write, mapping


@dataclass(frozen=True)
class Disturbance:
    """The manifest's `disturbance` section (profiles made by `neox-perf calibrate`)."""

    flagged: bool = False  # some of what the profile was fitted on was timed while disturbed
    warning: Optional[str] = None  # the line reports print when flagged
    samples: Optional[int] = None  # operator samples of the calibrated device and dtype
    disturbed: Optional[int] = None  # of them, still flagged as timed while disturbed
    extra: Mapping[str, Any] = field(default_factory=dict)  # per run: reference, baseline, readings

    ORDER = ("flagged", "warning", "samples", "disturbed", "max_slowdown", "runs")

    @classmethod
    def parse(cls, data: Any, where: str = "disturbance") -> "Disturbance":
        data = mapping(data, where)
        with reading(f"{where}.flagged", RETRAIN):
            flagged = data.get("flagged", False)
            if not isinstance(flagged, bool):
                raise TypeError(f"expected true or false, got {flagged!r}")
        return cls(flagged, _optional(data, "warning", text, where), _optional(data, "samples", int, where),
                   _optional(data, "disturbed", int, where),
                   extra={k: v for k, v in data.items() if k not in _typed(cls)})

    def to_dict(self) -> Dict[str, Any]:
        return _write(self, self.ORDER, always=("flagged",))


def describe(found: Mapping[str, Any]) -> List[str]:
    """A reading's findings (calibration/disturbance.Baseline.findings) in words."""
    why = []
    if "drift" in found:
        why.append(f"the reference took {1 + found['drift']:.2f}x its time at rest while other "
                   f"processes kept {found.get('others_cores', 0.0):.2f} cores busy")
    if "waited" in found:
        why.append(f"other processes held this CPU {found['waited']:.0%} of the reference's time")
    if found.get("gpu_neighbours"):
        why.append("other processes on the GPU: " + ", ".join(
            f"pid {p['pid']} ({p['memory_bytes'] / 2**30:.1f} GiB)" for p in found["gpu_neighbours"]))
    return why


def worst(findings: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Several readings' findings merged: the largest drift and wait, every GPU neighbour."""
    out: Dict[str, Any] = {}
    for f in findings:
        for key in ("drift", "waited", "others_cores"):
            if key in f:
                out[key] = max(out.get(key, 0.0), f[key])
        for n in f.get("gpu_neighbours") or ():
            if n not in out.setdefault("gpu_neighbours", []):
                out["gpu_neighbours"].append(n)
    return out


def from_calibration(name: str, runs: Sequence[Mapping[str, Any]], disturbed: int,
                     samples: int) -> Optional[Disturbance]:
    """The section of a profile fitted from a store: ``runs`` the store's calibration runs of the
    device (their info holds the watch's record under "disturbance"), ``disturbed`` how many of
    the ``samples`` operator samples fitted are still flagged. None when no run was watched."""
    records = [(r, r["info"]["disturbance"]) for r in runs
               if isinstance((r.get("info") or {}).get("disturbance"), Mapping)]
    if not records:
        return None
    after = [rec["after"] for _, rec in records if (rec.get("after") or {}).get("why")]
    # the steps after the operators, each watched whole (calibration/step_watch.py): those
    # still disturbed after their re-run
    steps = [s for _, rec in records for s in ((rec.get("steps") or {}).get("steps") or ())
             if s.get("still_disturbed")]
    flagged = disturbed > 0 or bool(after) or bool(steps)
    slowdown = max(float(rec.get("max_slowdown") or 0.0) for _, rec in records)
    noise = [rec["baseline"]["noise"] for _, rec in records if rec.get("baseline")]
    runs_out = [{"run": r["id"], **{k: rec.get(k) for k in (
        "reference", "loops", "baseline", "readings_taken", "max_slowdown", "max_waited", "max_drift",
        "windows", "disturbed_windows", "points", "retime", "machine", "reasons", "after", "steps")
        if rec.get(k) is not None}} for r, rec in records]
    warning = None
    if flagged:
        parts = []
        if disturbed:
            parts.append(f"{disturbed} of {samples} operator samples were timed while other "
                         f"work shared the machine")
        parts += [f"{a['what']}, {'; '.join(a['why'])}" for a in after]
        parts += [f"the {s['step']} step, {'; '.join(s.get('why') or ())}" for s in steps]
        found = worst([rec.get("reasons") or {} for _, rec in records]
                      + [a.get("found") or {} for a in after])
        seen = []
        if "waited" in found:
            seen.append(f"the reference waited for a CPU up to {found['waited']:.0%} of its time")
        if "drift" in found:
            seen.append(f"took up to {1 + found['drift']:.2f}x its time at rest while other "
                        f"processes kept up to {found.get('others_cores', 0.0):.2f} cores busy")
        if found.get("gpu_neighbours"):
            seen += describe({"gpu_neighbours": found["gpu_neighbours"]})
        if seen and noise:
            seen[-1] += f", beyond its own noise of {max(noise):.1%}"
        warning = (f"calibration disturbed: {'; '.join(parts)}"
                   + (f" ({', '.join(seen)})" if seen else "")
                   + f". Its predictions may be too slow. Fix: on a quiet machine, run the same "
                     f"`neox-perf calibrate --cluster {name}` again: it measures the flagged "
                     f"samples again and refits"
                   + (" (the collectives and the engine are measured again only into a new "
                      "--store)" if after or steps else "") + ".")
    return Disturbance(flagged, warning, samples, disturbed,
                       extra={"max_slowdown": slowdown, "runs": runs_out})


class Reference(NamedTuple):
    """The calibration's fixed reference, as its watch described it, and the reference's own
    cost per loop at the speed the profile describes (the calibration's start, the baseline's
    work: CPU time on a CPU, device time on a GPU; or the speed a profile fitted at one speed was
    brought to): to be read again later."""

    loops: int
    dtype: str
    device: str
    seconds_per_loop: float

    def speed_at(self, seconds_per_loop: Optional[float]) -> Optional[float]:
        """The machine's speed when the reference costs ``seconds_per_loop`` against the speed
        the profile describes: above 1, faster (None without a reading)."""
        return self.seconds_per_loop / seconds_per_loop if seconds_per_loop else None


# calibration/disturbance.Probe.describe: "11 x (256x256x256 GEMM + 1048576-element add), fp32 on cpu";
# the loops are also a run's own key from stop 58 on, the text's count read only where it is not
_REFERENCE = re.compile(r"^(\d+) x \(.*\), (\w+) on (\S+)$")


def reference(profile) -> Optional[Reference]:
    """The reference of the last watched calibration run behind ``profile`` (its manifest's
    disturbance section), or None: a profile not made by `calibrate`, or one whose run recorded
    no baseline. Its cost per loop is the speed the profile describes: the run's start, or for
    a profile fitted at one speed, that one."""
    ref = reference_of(getattr(getattr(profile, "manifest", None), "disturbance", None))
    from .one_speed import of_profile
    at = of_profile(profile)
    # a profile fitted at one speed describes the machine at that one (profile/one_speed.py)
    return ref._replace(seconds_per_loop=at.seconds_per_loop) if ref is not None and at is not None else ref


def reference_of(section: Optional[Disturbance]) -> Optional[Reference]:
    """``reference`` of a disturbance section itself (a profile's, or one being fitted)."""
    for run in reversed(list((section.extra.get("runs") or ()) if section is not None else ())):
        found = _REFERENCE.match(str(run.get("reference") or ""))
        work = (run.get("baseline") or {}).get("work")
        if found and isinstance(work, (int, float)) and work > 0:
            loops = run.get("loops")
            loops = loops if isinstance(loops, int) and loops > 0 else int(found.group(1))
            return Reference(loops, found.group(2), found.group(3), float(work) / loops)
    return None


def profile_warnings(profile) -> List[str]:
    """The warnings a report made with ``profile`` carries: its own calibration's, and those of
    the sampled profile a cluster description stands on; a description's values near the edge of
    their physical range (predictors/cluster_file.RANGES)."""
    out: List[str] = list(getattr(getattr(profile, "description", None), "warnings", ()) or ())
    for p in (profile, getattr(profile, "base", None)):
        manifest = getattr(p, "manifest", None)
        section = getattr(manifest, "disturbance", None)
        if section is not None and section.flagged and section.warning:
            line = f"profile {manifest.name}: {section.warning}"
            if line not in out:
                out.append(line)
    return out
