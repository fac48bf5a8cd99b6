"""Are the commands' outputs identical between two revisions of neox-perf?

Runs `neox-perf clusters`, `check`, `plan`, `report`, `calibrate` (resumed from a store
measured once), `calibrate --from-run` (the level correction of a bundled profile and the refit
of a calibrated one) and `validate` with each revision on the same inputs, at the same paths,
and compares what they print (--json, plus a few text renderings) and the profiles they leave
behind (manifest.json, and arrays.npz member by member).

    python benchmarks/outputs_identical.py --base main             # main vs this checkout
    python benchmarks/outputs_identical.py --base main --head HEAD  # two commits
    python benchmarks/outputs_identical.py --base main --work /tmp/ident --quick
    python benchmarks/outputs_identical.py --base main --checks     # `check` only, no inputs

--checks runs `check` alone (no calibrated profile, no hooked run: seconds, not minutes) on the
bundled examples and on GPT-NeoX's own configs from ../shared when present, at several GPU
counts and bundled clusters -- out-of-memory verdicts with the planner's layout that fits, the
faster-layout search, refusals -- as --json and as text.

Each revision runs from a copy of its files (`git archive`; "WORKTREE" is this checkout as it
is, untracked files included) through a folder that lays the repository out as the installed package (hooks/,
predictors/ and calibration/ inside neox_perf/), put first on PYTHONPATH, so the venv's own
install is not used. The inputs are made once with the base revision and kept in --work:
a calibrated profile `ident` (a small plan on 2 processes, the engine terms at their default
shapes: ~10 minutes on 2 cores) and a hooked 2-stage run of the reference workload. Every
revision starts from a fresh copy of them at the same paths.

Paths into a revision's own files (its bundled profiles) are compared as <src>/... . What is
compared where the output holds fresh measurements:
- calibrate: resumed from the complete store it measures nothing, so everything but its
  `seconds` (timing of the steps), its `disturbance` and `profile_warnings` (the reference
  probe's readings of the moment, docs/calibration-disturbance.md) and the written profile's
  training.seconds and `disturbance` section is compared (whether reports carry a profile's
  warning is compared through check, plan and report's `profile_warnings`);
  arrays.npz is compared member by member (its zip entries carry the time they were written);
- validate: measures a new iteration, so only what is predicted (predicted seconds, interval,
  coverage, the predicted side of every component and stage) and the profile's recorded
  validation minus its measured figures;
- calibrate --from-run: deterministic from the run's saved samples; the times of the
  history entries are left out.
Exit status 0 when everything compared is identical, 1 otherwise (the differences printed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from neox_perf.calibration.launch import free_port  # this driver's own launches

REPO = Path(__file__).resolve().parents[1]
MAPPED = ("hooks", "predictors", "calibration")  # setup.cfg's package_dir: inside neox_perf
EXAMPLES = ("gpt-20b.yml", "llama-13b.yml", "llemma-7b.yml")
BUNDLED = ("perlmutter-a100-80gb", "vista-gh200", "perlmutter-a100")
DESCRIPTION = "neox_perf/examples/clusters/dgx-a100.yml"
WINDOWS = "skip=3,warmup=1,active=2,every=4,repeat=2"
# Every operator of the reference workload's decomposition around the run's shapes, p2p and
# all-reduce (tests/hooks/test_from_run.py's plan), the norm and attention the engine
# calibration's shapes use besides (rmsnorm, flash attention) and the bundled examples' fused
# softmax and attention dropout.
PLAN = """
name: ident
protocol: {warmup: 1, repeats: 3}
defaults: {mp: 1, b: [1, 2], l: [16, 32, 64], d: [32, 64, 128], h: 4, vocab: 512}
ops:
  embedding: {}
  layernorm: {}
  rmsnorm: {}
  res_add: {}
  rope: {}
  linear1: {}
  linear2: {}
  linear3: {}
  linear4: {}
  linear_final: {}
  qk: {}
  fillmask: {}
  softmax: {}
  fused_softmax: {}
  attn_dropout: {}
  av: {}
  flash_attention: {causal: 1}
  gelu: {}
  cross_entropy: {}
  optimizer: {params: [16384, 65536, 131072, 262144, 524288]}
collectives:
  protocol: {warmup: 1, repeats: 3}
  p2p: {elements: [1024, 4096, 16384]}
  allreduce: {elements: [1024, 65536]}
"""
# tests/workload/workload_specs.py's tiny model (JSON is YAML)
WORKLOAD = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "max_position_embeddings": 32, "pos_emb": "rotary", "rotary_pct": 0.25,
            "no_weight_tying": True, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.003}}}
VOCAB = 500
# Keys whose values are fresh measurements or clock readings (see the docstring).
TIMING = {"seconds", "time", "search_seconds"}  # check: what its quick search took
PROBE = {"disturbance", "profile_warnings"}  # calibrate's watch of the machine, of the moment
TEXT_TIMING = re.compile(r"\bin \d+(\.\d+)? s\b")  # e.g. plan's "searched 2,082 layouts in 3.7 s"
# --checks: GPU counts x bundled clusters every NeoX config is checked at (4-GPU and 1-GPU
# A100 nodes, 1-GPU GH200 nodes: out of memory, the fitting-layout and faster-layout searches)
CHECK_GPUS = ("8", "16", "128")
CHECK_CLUSTERS = ("perlmutter-a100", "vista-gh200")
# validate's measured parts; `tracker`: the live-bytes window's own clock readings (its iteration
# and set-up seconds, and their ratio to the median iteration)
MEASURED = re.compile(r"measured|error|^iterations$|^notes$|^tracker$|mean_absolute|max_absolute|mean_signed")


def _source(rev: str, work: Path, label: str) -> Path:
    """A copy of the revision's files at work/src-<label> (labels of one length: the paths in
    the outputs, and the text wrapped around them, come out alike)."""
    out = work / f"src-{label}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if rev == "WORKTREE":  # tracked and untracked files as they are, ignored ones left out
        names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                               check=True, capture_output=True).stdout.decode().split("\0")
        for name in filter(None, names):
            if (REPO / name).is_file():
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, out / name)
        return out
    data = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev],
                          check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as fh:
        fh.write(data)
        fh.seek(0)
        with tarfile.open(fileobj=fh) as tar:
            tar.extractall(out)
    return out


def _shim(src: Path, work: Path, label: str) -> Path:
    """A folder whose neox_perf/ is the installed layout of the source tree at `src`."""
    site = work / f"site-{label}"
    shutil.rmtree(site, ignore_errors=True)
    pkg = site / "neox_perf"
    pkg.mkdir(parents=True)
    for entry in (src / "neox_perf").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name in MAPPED:
        (pkg / name).symlink_to(src / name)
    return site


class Revision:
    def __init__(self, label: str, rev: str, work: Path):
        self.label, self.rev, self.work = label, rev, work
        self.src = _source(rev, work, label)
        self.site = _shim(self.src, work, label)

    def env(self, home: Path) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PYTHON_NEOX_PERF_") and k not in ("NEOX_PERF_CLUSTER", "PYTHONPATH")}
        env.update(PYTHONPATH=str(self.site), OMP_NUM_THREADS="1", NEOX_PERF_HOME=str(home),
                   COLUMNS="160", TERM="dumb")
        return env

    def run(self, argv, home: Path, cwd: Path, timeout=3600):
        cmd = [sys.executable, "-m", "neox_perf.cli", *argv]
        proc = subprocess.run(cmd, env=self.env(home), cwd=str(cwd), capture_output=True,
                              text=True, timeout=timeout)
        return proc


def _make_inputs(base: Revision, work: Path) -> None:
    """The calibrated profile and the hooked run every revision starts from, at work/home.
    Made once; kept inputs whose plan is not PLAN are recalibrated (resumed: only the points
    PLAN adds are measured)."""
    home, cwd, inputs = work / "home", work / "cwd", work / "inputs"
    if inputs.is_dir():
        if (inputs / "plan.yml").read_text() == PLAN:
            return
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(inputs, home, symlinks=True)
        shutil.rmtree(inputs)
    (home / "stores").mkdir(parents=True, exist_ok=True)  # a failed attempt is resumed
    cwd.mkdir(exist_ok=True)
    (home / "plan.yml").write_text(PLAN)
    (home / "workload.yml").write_text(json.dumps({**WORKLOAD, "pipe_parallel_size": 2}))
    (home / "validate.yml").write_text(json.dumps(WORKLOAD))
    print(f"inputs: calibrating profile `ident` with {base.label} (~10 min)", flush=True)
    proc = base.run(["calibrate", "--cluster", "ident", "--plan", str(home / "plan.yml"),
                     "--store", str(home / "stores" / "ident.sqlite"), "--nproc", "2", "--json"],
                    home, cwd)
    if proc.returncode != 0:
        raise SystemExit(f"calibrate failed: {proc.stderr[-3000:]}")
    if (home / "run").is_dir():
        shutil.copytree(home, inputs, symlinks=True)
        return
    print("inputs: a hooked 2-stage run of the reference workload", flush=True)
    launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_nodes", "1", "--num_gpus", "2",
              "--master_port", str(free_port()), "--module", "neox_perf.calibration.workload.train",
              "--config", str(home / "workload.yml"), "--iters", "12", "--vocab-size", str(VOCAB),
              "--out", str(home / "workload-out.json")]
    proc = base.run(["run", "--run-dir", str(home / "run"), "--windows", WINDOWS, "--cluster",
                     "ident", "--", *launch], home, cwd)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stdout[-2000:]} {proc.stderr[-3000:]}")
    shutil.copytree(home, inputs, symlinks=True)


def _cases(quick: bool, src: Path):
    """(name, argv, kind): kind json|text|measured (json with the measured parts left out)|
    calibrate (json without the probe's readings).
    The examples are the revision's own (``src``), so their paths compare as <src>/..."""
    clusters = list(BUNDLED) + [str(src / DESCRIPTION), "ident"]
    yield "clusters", ["clusters", "--json"], "json"
    yield "clusters-text", ["clusters"], "text"
    for ex in EXAMPLES:
        path = str(src / "neox_perf" / "examples" / ex)
        yield f"check {ex} (no cluster)", ["check", path, "--gpus", "64", "--json"], "json"
        for c in clusters:
            yield f"check {ex} {Path(c).name}", ["check", path, "--gpus", "64", "--cluster", c, "--json"], "json"
        yield f"check {ex} text", ["check", path, "--gpus", "64", "--cluster", "perlmutter-a100-80gb"], "text"
        for c in (clusters if not quick else clusters[:1]):
            yield f"plan {ex} {Path(c).name}", ["plan", path, "--gpus", "64", "--cluster", c, "--json"], "json"
    yield "plan text", ["plan", str(src / "neox_perf" / "examples" / EXAMPLES[0]), "--gpus", "64",
                        "--cluster", "perlmutter-a100"], "text"
    yield "check calibrated text", ["check", "{home}/workload.yml", "--gpus", "2", "--cluster", "ident",
                                    "--vocab-size", str(VOCAB)], "text"
    for c in ("perlmutter-a100", "ident"):
        yield f"report {c}", ["report", "{home}/run", "--cluster", c, "--json"], "json"
    yield "report text", ["report", "{home}/run", "--cluster", "ident"], "text"
    if quick:
        return
    yield "calibrate (resumed)", ["calibrate", "--cluster", "ident2", "--plan", "{home}/plan.yml",
                                  "--store", "{home}/stores/ident.sqlite", "--nproc", "2", "--json"], "calibrate"
    yield "validate", ["validate", "{home}/validate.yml", "--gpus", "1", "--cluster", "ident",
                       "--iters", "3", "--vocab-size", str(VOCAB), "--json"], "measured"
    yield "from-run level", ["calibrate", "--cluster", "perlmutter-a100-80gb", "--from-run", "{home}/run",
                             "--json"], "json"
    yield "from-run refit", ["calibrate", "--cluster", "ident", "--from-run", "{home}/run", "--json"], "json"


def _neox_configs():
    """GPT-NeoX's own configs from the project's shared data, each file one config; none when
    ../shared is absent."""
    from neox_perf.predictors.fitting.devset import find_shared
    shared = find_shared(REPO)
    root = shared / "data" / "gpt-neox-configs" if shared else None
    if root is None or not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*.yml") if "finetuning" not in p.parts)


def _check_cases(src: Path):
    """(name, argv, kind) of --checks: `check` alone, on every input that needs no profile of
    our own making."""
    for ex in EXAMPLES:
        path = str(src / "neox_perf" / "examples" / ex)
        for gpus in ("8", "64"):
            for c in (None,) + BUNDLED:
                where = ["--cluster", c] if c else []
                yield (f"check {ex} --gpus {gpus} {c or '(no cluster)'}",
                       ["check", path, "--gpus", gpus, *where, "--json"], "json")
        yield f"check {ex} text", ["check", path, "--gpus", "64", "--cluster", "perlmutter-a100"], "text"
    for cfg in _neox_configs():
        name = "/".join(cfg.parts[-2:]) if cfg.parent.name != "gpt-neox-configs" else cfg.name
        for gpus in CHECK_GPUS:
            for c in CHECK_CLUSTERS:
                yield (f"check {name} --gpus {gpus} {c}",
                       ["check", str(cfg), "--gpus", gpus, "--cluster", c, "--json"], "json")
        yield (f"check {name} --gpus 16 text",
               ["check", str(cfg), "--gpus", "16", "--cluster", "perlmutter-a100"], "text")


def _strip(value, drop):
    if isinstance(value, dict):
        return {k: _strip(v, drop) for k, v in value.items() if not drop(k)}
    if isinstance(value, list):
        return [_strip(v, drop) for v in value]
    return value


def _relocate(value, src: str):
    """Paths into the revision's own source tree (its bundled profiles) as <src>/..."""
    if isinstance(value, str):
        return value.replace(src, "<src>")
    if isinstance(value, dict):
        return {k: _relocate(v, src) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocate(v, src) for v in value]
    return value


def _output(proc, kind, src: str):
    out = {"exit": proc.returncode, "stderr": proc.stderr.strip().replace(src, "<src>")}
    if kind == "text":
        out["stdout"] = TEXT_TIMING.sub("in <t> s", proc.stdout).replace(src, "<src>")
        return out
    try:
        data = _relocate(json.loads(proc.stdout), src)
    except ValueError:
        out["stdout"] = proc.stdout.replace(src, "<src>")
        return out
    data = _strip(data, lambda k: k in TIMING)
    if kind == "calibrate":
        data = _strip(data, lambda k: k in PROBE)
    if kind == "measured":
        out["stderr"] = ""  # progress lines carry measured times
        data = _strip(data, lambda k: bool(MEASURED.search(k)))
    out["json"] = data
    return out


def _profiles(home: Path):
    """Every profile directory under home/profiles: its manifest (timings and the arrays'
    checksum left out) and its arrays, member by member."""
    import numpy as np
    out = {}
    root = home / "profiles"
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else ():
        entry = {"files": sorted(p.name for p in d.iterdir())}
        manifest = d / "manifest.json"
        if manifest.is_file():
            m = json.loads(manifest.read_text())
            (m.get("arrays") or {}).pop("sha256", None)
            (m.get("training") or {}).pop("seconds", None)
            m.pop("disturbance", None)  # the probe's readings while it was calibrated
            prov = m.get("provenance") or {}
            for run in prov.get("runs") or []:  # when each calibration step ran
                run.pop("started", None)
                run.pop("finished", None)
            for f in prov.get("files") or []:  # the store: it records when each step ran
                if f.get("kind") == "store":
                    f.pop("sha256", None)
            for run in (m.get("provenance") or {}).get("from_runs") or []:
                run.pop("time", None)
            (m.get("provenance") or {}).get("recalibrated", {}).pop("time", None)
            val = m.get("validation")
            if val:  # measured by each revision's own validate
                m["validation"] = {"runs": [{"config": r["config"], "predicted": r["predicted"],
                                             "extrapolated_share": r["extrapolated_share"]}
                                            for r in val.get("runs", [])]}
            entry["manifest"] = m
        arrays = d / "arrays.npz"
        if arrays.is_file():
            with np.load(arrays, allow_pickle=False) as z:
                entry["arrays"] = {k: z[k].tolist() for k in sorted(z.files)}
        out[d.name] = entry
    return out


def _outputs(rev: Revision, work: Path, quick: bool, checks: bool = False):
    home, cwd = work / "home", work / "cwd"
    shutil.rmtree(home, ignore_errors=True)
    if checks:
        home.mkdir(parents=True)
    else:
        shutil.copytree(work / "inputs", home, symlinks=True)
    cwd.mkdir(exist_ok=True)
    results = {}
    for name, argv, kind in (_check_cases(rev.src) if checks else _cases(quick, rev.src)):
        argv = [a.replace("{home}", str(home)) for a in argv]
        print(f"  {rev.label}: {name}", flush=True)
        results[name] = _output(rev.run(argv, home, cwd), kind, str(rev.src))
    results["profiles left"] = _relocate(_profiles(home), str(rev.src))
    return results


def _diff(a, b, path="", out=None, limit=40):
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'head' if k in b else 'base'}")
            else:
                _diff(a[k], b[k], f"{path}/{k}", out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, limit)
    elif a != b:
        show = lambda v: (json.dumps(v)[:300] if not isinstance(v, str) else v[:300])
        out.append(f"{path}: base {show(a)!s} | head {show(b)!s}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="git revision to compare against (default main)")
    ap.add_argument("--head", default="WORKTREE", help="git revision, or WORKTREE: this checkout as it is")
    ap.add_argument("--work", help="working folder, kept (default: a temporary one, removed); "
                                   "the inputs made in it are reused by the next run")
    ap.add_argument("--quick", action="store_true",
                    help="check, plan, report and clusters only (no calibrate, validate, --from-run)")
    ap.add_argument("--checks", action="store_true",
                    help="`check` only, on the examples and GPT-NeoX's configs (no inputs to make)")
    args = ap.parse_args(argv)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="outputs-identical-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base = Revision("base", args.base, work)
        head = Revision("head", args.head, work)
        if not args.checks:
            _make_inputs(base, work)
        got = {}
        for rev in (base, head):
            print(f"{rev.label} = {rev.rev}", flush=True)
            got[rev.label] = _outputs(rev, work, args.quick, args.checks)
        bad = 0
        for name in got["base"]:
            diffs = _diff(got["base"][name], got["head"][name])
            print(f"{'identical' if not diffs else 'DIFFERENT'}: {name}")
            if name != "profiles left" and got["base"][name]["exit"] not in (0, 3):  # 3: a verdict
                print(f"    (base exits {got['base'][name]['exit']}: {got['base'][name]['stderr'][-300:]})")
            for d in diffs:
                print(f"    {d}")
            bad += bool(diffs)
        print(f"{len(got['base']) - bad} of {len(got['base'])} outputs identical "
              f"({args.base} vs {args.head})")
        return 1 if bad else 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
