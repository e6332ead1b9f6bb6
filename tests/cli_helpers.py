"""Helpers of the tests that run the `llmpy` command in a subprocess (imported by the test modules;
pytest puts this folder on sys.path)."""
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def llmpy(*args, cwd=None, env=None):
    """`python -m llmpy ARGS` with this checkout's src first on PYTHONPATH (env: more variables)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "llmpy", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def assert_one_line_error(res, *needles):
    """A failed run that said one line on stderr, no traceback, with every needle in it."""
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = [l for l in res.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def config_error(desc):
    """llmpy.config's own message for a descriptor it refuses (the tools pass it on after the flag)."""
    from llmpy.config import ConfigError, parse_descriptor
    try:
        parse_descriptor(desc)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"{desc} is a model descriptor")
