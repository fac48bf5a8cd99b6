"""Which exit code a failure gets: a command line naming something unusable is a usage error
(2), data that cannot be used -- a run dir's -- a data error (1, as an invalid config), and
anything else a bug (4), never disguised as a usage error."""
import json

import pytest

from neox_perf import exitcodes
from neox_perf.cli import main
from neox_perf.errors import NeoxPerfError, ProfileError, UsageError
from neox_perf.prediction.predict import load_cluster
from neox_perf.runs import FromRunError, RunError
from neox_perf.runs.report import ReportError


def test_run_errors_are_data_errors():
    for cls in (RunError, FromRunError, ReportError):
        assert issubclass(cls, NeoxPerfError) and not issubclass(cls, UsageError)
    assert FromRunError("a\n b (fix: c)").line() == "a b (fix: c)"


def test_a_run_dir_without_data_or_missing_is_a_data_error(tmp_path, capsys):
    # missing, as a missing config file is: a data error (issue 32), with a fix
    assert main(["report", str(tmp_path / "nope"), "--json"]) == exitcodes.INVALID_CONFIG
    out, err = capsys.readouterr()
    assert json.loads(out)["exit_code"] == exitcodes.INVALID_CONFIG and "fix:" in err
    code = main(["report", str(tmp_path), "--json"])  # there, but no rank wrote a summary
    out, err = capsys.readouterr()
    assert code == exitcodes.INVALID_CONFIG and json.loads(out)["exit_code"] == exitcodes.INVALID_CONFIG
    line = err.strip()
    assert len(line.splitlines()) == 1 and str(tmp_path) in line and "no rank summaries" in line


def test_load_cluster_turns_only_an_unusable_profile_into_a_usage_error(tmp_path, monkeypatch):
    # a path that is not there is named as typed (#26), a usage error like every unusable profile
    with pytest.raises(UsageError, match="nope.yml: no such file or directory"):
        load_cluster(str(tmp_path / "nope.yml"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{")
    with pytest.raises(UsageError, match="unreadable profile manifest"):
        load_cluster(str(tmp_path / "bad"))
    from neox_perf.predictors import profile as loader

    def bug(name):
        raise ZeroDivisionError("a bug in the loader")
    monkeypatch.setattr(loader, "load_profile", bug)
    with pytest.raises(ZeroDivisionError):  # a bug stays a bug: the CLI reports it as internal
        load_cluster("perlmutter-a100-80gb")
    assert issubclass(ProfileError, NeoxPerfError)


def test_a_bug_while_loading_a_cluster_exits_internal(monkeypatch, capsys):
    from neox_perf.predictors import profile as loader

    def bug(name):
        raise ZeroDivisionError("a bug in the loader")
    monkeypatch.setattr(loader, "load_profile", bug)
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "neox_perf" / "examples" / "gpt-20b.yml"
    code = main(["check", str(example), "--gpus", "64", "--cluster", "perlmutter-a100-80gb"])
    assert code == exitcodes.INTERNAL and "ZeroDivisionError" in capsys.readouterr().err
