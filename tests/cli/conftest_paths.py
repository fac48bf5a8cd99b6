from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "neox_perf" / "examples"
# the project's `shared/` beside the repo, or beside an ancestor (a git worktree under it)
SHARED = next((p.parent / "shared" for p in [REPO, *REPO.parents]
               if p.name and (p.parent / "shared" / "data").is_dir()), REPO.parent / "shared")
NEOX_CONFIGS = SHARED / "data" / "gpt-neox-configs"
