"""Run the CLI in-process for a test: (exit code, stdout, stderr), or check's JSON envelope."""
import contextlib
import io
import json

from neox_perf.cli import main


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def check_json(*argv):
    code, out, err = run(["check", *argv, "--json"])
    assert out, err
    return code, json.loads(out)
