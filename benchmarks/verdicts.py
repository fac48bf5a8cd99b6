"""`neox-perf check` on every GPT-NeoX config: the table of verdicts, and how many end in which.

Each YAML under CONFIGS is checked as NeoX's README runs it: a file that is only an overlay (no
num_layers: local_setup.yml, cpu_mock_config.yml, prof.yml, sparse.yml) after 125M.yml; a model
that sets no batch with a batch file (micro-batch 1, accumulation 8). GPUs: --gpus, else the
config's own pipe x model parallel times --dp (default 4 data-parallel replicas).

    python benchmarks/verdicts.py [--configs ../shared/data/gpt-neox-configs]
        [--cluster perlmutter-a100-80gb] [--dp 4] [--json]

Exit 0 when every config ended in a verdict (an error, a failed verdict, a warning or OK), 1 when
one crashed or printed no verdict.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
BATCH = "train_micro_batch_size_per_gpu: 1\ngradient_accumulation_steps: 8\n"


def default_configs() -> Optional[Path]:
    from neox_perf.predictors.fitting.devset import find_shared
    shared = find_shared(REPO)
    root = shared / "data" / "gpt-neox-configs" if shared else None
    return root if root is not None and root.is_dir() else None


def _yaml(path: Path) -> dict:
    import yaml
    try:
        data = yaml.safe_load(path.read_text())
    except Exception:  # noqa: BLE001 - check reports the file's own error
        return {}
    return {str(k).replace("-", "_"): v for k, v in data.items()} if isinstance(data, dict) else {}


def files_for(path: Path, root: Path, batch_file: str) -> List[str]:
    """The files deepy.py would be given for this config."""
    values = _yaml(path)
    files = [str(path)]
    if "num_layers" not in values:  # an overlay: NeoX's README merges it after a model
        files = [str(root / "125M.yml"), str(path)]
        values = dict(_yaml(root / "125M.yml"), **values)
    if values.get("train_batch_size") is None and values.get("train_micro_batch_size_per_gpu") is None:
        files.append(batch_file)
    return files


def gpus_for(files: List[str], dp: int) -> int:
    values = {}
    for f in files:
        values.update(_yaml(Path(f)))
    pp = max(int(values.get("pipe_parallel_size") or 0), 1)
    mp = max(int(values.get("model_parallel_size") or 0), 1)
    return pp * mp * dp


def check_one(files: List[str], gpus: int, cluster: Optional[str]) -> dict:
    from neox_perf.cli import main
    argv = ["check", *files, "--gpus", str(gpus), "--json"] + (["--cluster", cluster] if cluster else [])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    try:
        data = json.loads(out.getvalue())
    except ValueError:
        data = {}
    if "error" in data:  # refused before a report (one line): an error verdict all the same
        level, text, findings = "error", data["error"]["message"], ["config_error"]
    elif "verdict" in data:
        level, text = data["verdict"]["level"], data["verdict"]["text"]
        findings = [v["code"] for v in data["verdicts"] if v["level"] in ("warning", "fail", "error")]
    else:
        level, text, findings = "crash", (err.getvalue().strip() or "no output"), []
    pred = data.get("prediction") or {}
    return {"files": files, "gpus": gpus, "exit_code": code, "level": level, "verdict": text,
            "findings": findings, "iteration_seconds": pred.get("iteration_seconds")}


@contextlib.contextmanager
def configs_as_run(configs: Path) -> Iterator[Tuple[str, List[Tuple[Path, List[str]]]]]:
    """(the batch file, [(config, the files deepy.py would be given)]) for every YAML under
    ``configs``; the batch file lives as long as the block."""
    with tempfile.TemporaryDirectory() as tmp:
        batch = os.path.join(tmp, "batch.yml")
        Path(batch).write_text(BATCH)
        yield batch, [(path, files_for(path, configs, batch)) for path in sorted(configs.rglob("*.yml"))]


def table(configs: Path, cluster: Optional[str], dp: int, gpus: Optional[int] = None) -> List[dict]:
    rows = []
    with configs_as_run(configs) as (batch, runs):
        for path, files in runs:
            row = check_one(files, gpus or gpus_for(files, dp), cluster)
            row["config"] = str(path.relative_to(configs))
            row["files"] = [("<batch>" if f == batch else os.path.relpath(f, configs)) for f in files]
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=Path, default=default_configs(),
                    help="directory of GPT-NeoX configs (default: ../shared/data/gpt-neox-configs)")
    ap.add_argument("--cluster", default="perlmutter-a100-80gb",
                    help="cluster profile (default perlmutter-a100-80gb; '' for none)")
    ap.add_argument("--dp", type=int, default=4, help="data-parallel replicas per config (default 4)")
    ap.add_argument("--gpus", type=int, help="the same GPU count for every config instead")
    ap.add_argument("--json", action="store_true", help="the rows as JSON")
    args = ap.parse_args()
    if args.configs is None or not args.configs.is_dir():
        print("no GPT-NeoX configs directory (pass --configs DIR)", file=sys.stderr)
        return 1
    rows = table(args.configs, args.cluster or None, args.dp, args.gpus)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(len(r["config"]) for r in rows)
        print(f"{'config':{width}}  {'GPUs':>5}  exit  {'verdict':8} {'s/it':>8}  findings")
        for r in rows:
            it = f"{r['iteration_seconds']:.3g}" if r["iteration_seconds"] else "-"
            others = [f for f in r["files"] if f != r["config"]]
            extra = f" (with {', '.join(others)})" if others else ""
            print(f"{r['config']:{width}}  {r['gpus']:>5}  {r['exit_code']:>4}  {r['level'].upper():8} "
                  f"{it:>8}  {', '.join(dict.fromkeys(r['findings'])) or '-'}{extra}")
        counts = collections.Counter(r["level"] for r in rows)
        print(f"\n{len(rows)} configs on {args.cluster or 'no cluster'}: " + ", ".join(
            f"{counts[k]} {k.upper()}" for k in ("error", "fail", "warning", "ok", "crash") if counts[k]))
    return 0 if all(r["level"] != "crash" for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
