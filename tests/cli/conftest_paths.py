from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "neox_perf" / "examples"
NEOX_CONFIGS = REPO.parent / "shared" / "data" / "gpt-neox-configs"
