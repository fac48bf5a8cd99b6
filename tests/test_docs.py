"""README.md is for users and short; docs/ holds the rest (issue 26, section 5). Every relative
link in README.md and docs/*.md resolves to a file (and to a heading, for an anchor), every
repository path the text names in backticks exists, every page of docs/ is reachable from the
README, and the README names no path a user does not have."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README] + sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 160
# Paths and words that exist only on the development machine or in a developer's checkout.
DEVELOPER_ONLY = ("../shared", "/work/", "shared/data", "development box", "development machine",
                  "worktree", "2-core box")
# setup.cfg's package_dir: an installed path under neox_perf/ lives at the top of the repository.
INSTALLED_AT = {"neox_perf/hooks/": "hooks/", "neox_perf/predictors/": "predictors/",
                "neox_perf/calibration/": "calibration/"}
TOP_LEVEL = ("neox_perf/", "hooks/", "predictors/", "calibration/", "benchmarks/", "tests/",
             "docs/", ".ci/")

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code, where a bracket is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    seen, out = {}, set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


def _links(path: Path):
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


def _resolve(page: Path, target: str):
    file_part, _, anchor = target.partition("#")
    return (page.parent / file_part).resolve() if file_part else page, anchor


def test_the_slugs_follow_github():
    assert _slug("The 80% interval") == "the-80-interval"
    assert _slug("calibrate --from-run") == "calibrate---from-run"
    assert _slug("Is my throughput normal? (`report` on a NeoX log)") == \
        "is-my-throughput-normal-report-on-a-neox-log"
    assert _slug("A calibrated profile's interval") == "a-calibrated-profiles-interval"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\nsee [there](missing.md) and [here](#title) and [no](#nowhere)\n"
                    "`[not a link](nothing.md)`\n```\n[nor](this.md)\n```\n")
    found = list(_links(page))
    assert found == ["missing.md", "#title", "#nowhere"]
    assert not _resolve(page, "missing.md")[0].exists()
    assert "title" in _anchors(page) and "nowhere" not in _anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, anchor = _resolve(page, target)
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def _repo_paths(page: Path):
    """Backticked paths into this repository (`benchmarks/endtoend.py`), placeholders skipped."""
    for span in CODE_SPAN.findall(page.read_text()):
        for word in span.split():
            word = word.rstrip(".,;:)").split(":")[0]
            if word.startswith(TOP_LEVEL) and not re.search(r"[*<>$]|\.\.\.", word):
                yield word


def _missing_paths(page: Path):
    missing = []
    for word in _repo_paths(page):
        rel = next((top + word[len(inst):] for inst, top in INSTALLED_AT.items()
                    if word.startswith(inst)), word)
        folder, _, name = rel.rpartition("/")
        module = f"{folder}/{name.split('.')[0]}.py"  # predictors/transfer.link_transfer
        if not (REPO / rel).exists() and not (REPO / module).exists():
            missing.append(word)
    return missing


def test_a_stale_path_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`predictors/cleaning.py` and `predictors/fitting/cleaning.py`, "
                    "`neox_perf/hooks/site`, `predictors/transfer.link_transfer`, "
                    "`RUN_DIR/samples-<host>.sqlite`, `calibration/plans/*.yml`\n")
    assert _missing_paths(page) == ["predictors/cleaning.py"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_named_exists(page):
    missing = _missing_paths(page)
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {sorted(set(missing))}"


def test_every_page_of_docs_is_reachable_from_the_readme():
    reached, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in _links(page):
            path, _ = _resolve(page, target)
            if path.suffix == ".md" and path.exists():
                todo.append(path)
    orphans = [p.name for p in PAGES if p.resolve() not in reached]
    assert not orphans, f"docs pages no link leads to from README.md: {orphans}"


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move details to docs/")


def test_the_readme_names_no_developer_only_path():
    text = README.read_text()
    found = [w for w in DEVELOPER_ONLY if w in text]
    assert not found, f"README.md names what users do not have: {found}"


def test_the_readme_keeps_the_commands_ci_runs():
    """.ci/run reads the line two after each marker (the fence, then the command)."""
    lines = README.read_text().splitlines()
    for marker, must in (("<!-- ci:install -->", "pip install"), ("<!-- ci:test -->", "pytest")):
        assert marker in lines, f"README.md lost its {marker} marker"
        i = lines.index(marker)
        assert lines[i + 1].startswith("```") and must in lines[i + 2], (marker, lines[i + 1:i + 3])
    assert lines.index("<!-- ci:install -->") < 20, "the install command belongs at the top"
