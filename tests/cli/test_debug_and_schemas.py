"""The CLI's error paths: one line by default, the traceback with --debug on every command,
and a schema per payload (``calibrate --from-run`` has its own)."""
import contextlib
import io
import json

import pytest

from neox_perf import exitcodes
from neox_perf.cli import build_parser, main
from neox_perf.render.envelope import SCHEMA_VERSIONS, envelope

from conftest_paths import EXAMPLES


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_every_command_takes_debug():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) >= {"check", "plan", "clusters", "calibrate", "validate", "run", "report"}
    for name, parser in sub.choices.items():
        assert any("--debug" in a.option_strings for a in parser._actions), name


@pytest.fixture
def broken_check(mocker):
    """A bug inside the check command (the bundled example is fine)."""
    return mocker.patch("neox_perf.commands.check.raw_vocab", side_effect=KeyError("boom"))


def test_an_internal_error_is_one_line_without_debug(broken_check):
    code, out, err = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--json"])
    assert code == exitcodes.INTERNAL and broken_check.called
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "internal error: KeyError" in err and "--debug" in err
    assert json.loads(out)["error"]["message"].startswith("internal error: KeyError")


def test_debug_prints_the_traceback_then_the_line(broken_check):
    code, _, err = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--debug"])
    assert code == exitcodes.INTERNAL
    lines = err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert any("run_check" in line for line in lines)  # where it failed
    assert lines[-1].startswith("neox-perf: internal error: KeyError")


def test_debug_shows_the_traceback_of_a_usage_error_too():
    code, _, err = run(["check", str(EXAMPLES / "gpt-20b.yml"), "--cluster", "no-such", "--debug"])
    assert code == exitcodes.USAGE
    assert "Traceback" in err and "UsageError" in err
    assert err.strip().splitlines()[-1].startswith("neox-perf: no-such")


def test_calibrate_from_run_has_its_own_schema(tmp_path):
    code, out, _ = run(["calibrate", "--cluster", "x", "--from-run", str(tmp_path / "none"), "--json"])
    data = json.loads(out)
    assert code == exitcodes.USAGE and data["command"] == "calibrate"
    assert data["schema"] == "neox-perf/calibrate-from-run/v1"


def test_each_payload_names_its_schema():
    assert set(SCHEMA_VERSIONS) >= {"check", "calibrate", "calibrate-from-run", "validate",
                                    "report", "run", "clusters", "plan"}
    assert envelope("check", 0, {})["schema"] == "neox-perf/check/v1"
    assert envelope("calibrate", 0, {}, "calibrate-from-run")["schema"] == "neox-perf/calibrate-from-run/v1"
