"""The README's "Your own model" section runs as written: its module saved as ``mymodel.py``, its command run in
that directory by the ``spmd`` console script, and the run equal to one device (``--check``)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _section_blocks():
    section = (ROOT / "README.md").read_text().split("## Your own model\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"```(python|bash)\n(.*?)```", section, re.S))


@pytest.mark.slow  # the spmd command in a subprocess, run and checked against one device: 15-45 s
def test_the_readme_model_runs_as_written_and_equals_one_device(tmp_path):
    blocks = _section_blocks()
    (tmp_path / "mymodel.py").write_text(blocks["python"])
    command = shlex.split(blocks["bash"].strip())
    assert command[:2] == ["spmd", "run"] and "--check" in command
    # The console script, run from the directory holding mymodel.py (not on the path otherwise: python -P).
    entry = "import sys; from spmd.cli import command_line; sys.argv[0] = 'spmd'; command_line()"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [*command[1:], "--steps", "3", "--json"]
    r = subprocess.run(
        [sys.executable, "-P", "-c", entry, *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "mymodel:factory"
    assert out["max_abs_diff"] <= 1e-4
    assert len(out["losses"]) == 3 and out["losses"][-1] < out["losses"][0]
