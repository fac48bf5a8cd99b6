"""Every cluster profile is written by one module, neox_perf/profile/directory.py, as a new
version beside the old one swapped in whole: no other module even names the manifest or the
arrays file, and a writer killed at any point (SIGKILL: nothing runs on the way out) leaves the
old profile readable -- or the new one, once the swap is done."""
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_import_layers import MODULES, REPO

from neox_perf.predictors import load_profile
from neox_perf.profile import directory
from neox_perf.profile.directory import bundled_dir

WRITER = "neox_perf.profile.directory"
FILES = ("manifest.json", "arrays.npz")
NAMES = ("MANIFEST_FILE", "ARRAYS_FILE")
# Compares the profiles two revisions wrote from outside either of them: it reads the files.
OUTSIDE = {"benchmarks/outputs_identical.py"}


def _docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                yield body[0].value


def naming(path: Path):
    """(line, what) wherever the source names a profile file: a string holding its name (not a
    docstring) or the constant that holds it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = {id(d) for d in _docstrings(tree)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                and any(f in node.value for f in FILES)):
            yield node.lineno, node.value
        elif isinstance(node, ast.Name) and node.id in NAMES:
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute) and node.attr in NAMES:
            yield node.lineno, node.attr
        elif isinstance(node, ast.alias) and node.name in NAMES:
            yield getattr(node, "lineno", 0), node.name


def _sources():
    for name, path in MODULES.items():
        yield name, path
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel not in OUTSIDE:
            yield rel, path


def test_only_the_directory_module_names_the_profile_files():
    found = {name: list(naming(path)) for name, path in _sources()}
    assert found[WRITER], "the scan must see the writer's own constants"
    elsewhere = {name: hits for name, hits in found.items() if hits and name != WRITER}
    assert not elsewhere, f"read and write profiles through {WRITER}: {elsewhere}"


def test_the_scan_sees_a_write_elsewhere(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Docstrings may say manifest.json."""\nimport json\n'
                       'def save(d, m):\n    """manifest.json too"""\n'
                       '    (d / "manifest.json").write_text(json.dumps(m))\n')
    assert [what for _, what in naming(planted)] == ["manifest.json"]


# -- killed writers ----------------------------------------------------------------------------

CHILD = r"""
import os, signal, sys
from dataclasses import replace
import numpy as np
from neox_perf.profile import directory as d

point, final = sys.argv[1], sys.argv[2]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

arrays = None
if point == "arrays":  # half an arrays file written
    with np.load(os.path.join(final, "arrays.npz")) as z:
        arrays = {k: z[k] for k in z.files}
    def half(fh, **members):
        fh.write(b"PK\x03\x04 half an arrays file")
        fh.flush()
        die()
    np.savez = half
elif point == "manifest":  # half the new manifest written
    real = d.json.dumps
    d.json.dumps = lambda *a, **k: real(*a, **k)[:1000]
    d.os.fsync = die
elif point == "swap":  # the new version complete, not swapped in
    d._exchange = die
elif point == "between renames":  # no renameat2: the old version moved aside, the new not in
    d._exchange = lambda a, b: False
    real_rename, calls = os.rename, []
    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:
            die()
        return real_rename(a, b)
    d.os.rename = rename
elif point == "cleanup":  # swapped in, the old version not yet removed
    d.shutil.rmtree = die
manifest = d.read(final)
with d.replacing(final) as tmp:
    d.write(tmp, replace(manifest, notes=manifest.notes + ("new version",)), arrays=arrays,
            arrays_from=None if arrays is not None else final)
"""
POINTS = ("arrays", "manifest", "swap", "between renames", "cleanup")


@pytest.fixture()
def profile_copy(tmp_path):
    final = tmp_path / "profiles" / "p"
    shutil.copytree(bundled_dir() / "perlmutter-a100-80gb", final)
    return final


def _state(final: Path):
    p = load_profile(str(final))
    return (p.manifest.notes, p.predict("linear1", "fwd", {"m": 8192, "k": 4096, "n": 4096}).seconds,
            p.predict_collective("allreduce", 1e8, 2, 4).seconds)


@pytest.mark.parametrize("point", POINTS)
def test_a_writer_killed_at_any_point_leaves_a_whole_profile(profile_copy, point):
    notes, linear, allreduce = _state(profile_copy)
    proc = subprocess.run([sys.executable, "-c", CHILD, point, str(profile_copy)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    swapped = point == "cleanup"
    left = [p.name for p in profile_copy.parent.iterdir() if p.name.startswith(".")]
    assert left or point == "between renames", "the killed writer left its work beside the profile"
    got_notes, got_linear, got_allreduce = _state(profile_copy)  # the loader puts an aside back
    assert got_notes == (notes + ("new version",) if swapped else notes)
    assert (got_linear, got_allreduce) == (linear, allreduce)
    # the next writer clears what the killed one left, and its version is the one read
    directory.update(profile_copy, lambda m: m)
    assert sorted(p.name for p in profile_copy.parent.iterdir()) == ["p"]
    assert _state(profile_copy) == (got_notes, linear, allreduce)


def test_update_carries_every_other_file_and_keeps_the_arrays(profile_copy):
    (profile_copy / "README").write_text("mine")
    before = {p.name: p.read_bytes() for p in profile_copy.iterdir() if p.name != "manifest.json"}
    written = directory.update(profile_copy, lambda m: m)
    after = {p.name: p.read_bytes() for p in profile_copy.iterdir() if p.name != "manifest.json"}
    assert after == before
    assert json.loads((profile_copy / "manifest.json").read_text()) == written.to_dict()


def test_a_failing_change_leaves_the_profile_as_it_was(profile_copy):
    before = {p.name: p.read_bytes() for p in profile_copy.iterdir()}

    def bad(m):
        raise RuntimeError("the change failed")
    with pytest.raises(RuntimeError):
        directory.update(profile_copy, bad)
    assert {p.name: p.read_bytes() for p in profile_copy.iterdir()} == before
    assert sorted(os.listdir(profile_copy.parent)) == ["p"]


def test_a_writer_inside_a_pending_version_writes_it_and_leaves_nothing_astray(profile_copy):
    """A refit builds its new version with the helpers that write a whole profile (fit, engine
    terms, its own record): `update` of that pending version changes it in place, and a nested
    `replacing` names its temporary directory after the profile, where the next writer after a
    kill finds it (a name it did not match was left behind for good)."""
    parent = profile_copy.parent
    with directory.replacing(profile_copy) as tmp:
        for entry in profile_copy.iterdir():
            shutil.copy2(entry, tmp / entry.name)
        before = set(os.listdir(parent))
        directory.update(tmp, lambda m: dataclasses.replace(m, notes=m.notes + ("in place",)))
        assert set(os.listdir(parent)) == before  # no version of the version
        with directory.replacing(tmp) as inner:
            assert inner.name.startswith(f".{profile_copy.name}.tmp-{os.getpid()}-")
            directory.write(inner, directory.read(tmp), arrays_from=tmp)
            directory.recover_dir(profile_copy)  # this process is alive: nothing of it is touched
            assert inner.is_dir() and tmp.is_dir()
    assert directory.read(profile_copy).notes[-1] == "in place"
    assert sorted(os.listdir(parent)) == ["p"]
    assert directory._PENDING == {}
    assert _state(profile_copy)[1:] == _state(bundled_dir() / "perlmutter-a100-80gb")[1:]
