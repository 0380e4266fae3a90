"""README.md's "Checking your own program": its commands, read from README.md itself and run as
written (in an empty folder, `attnstep` in this process), so the README and the example cannot
drift apart: examples/my_attention.py passes `check` with the README's `--name` options, and with
`--bug` fails attention_weights with the diagnosis softmax_axis."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import invoke
from helpers.environment import REPO

SECTION = "## Checking your own program"


def _readme_commands() -> dict:
    """The section's transcript commands (`$ ...`), by program: generate, the example, check."""
    text = (REPO / "README.md").read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    lines = block.splitlines()
    commands = [shlex.split(line[2:]) for line in lines if line.startswith("$ ")]
    by_name = {" ".join(c[:2]): c for c in commands}
    assert set(by_name) == {"attnstep generate", "python3 examples/my_attention.py", "attnstep check"}, commands
    assert f"`{shlex.join(by_name['python3 examples/my_attention.py'])} --bug`" in section
    # What the example prints, as shown: the line after its command.
    by_name["example prints"] = lines[next(i for i, ln in enumerate(lines) if "my_attention.py" in ln) + 1]
    return by_name


def _run_example(command, *extra):
    proc = subprocess.run([sys.executable, str(REPO / command[1]), *command[2:], *extra],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def commands(tmp_path, monkeypatch):
    """The README's commands, run from an empty folder (data/random_test and my_out there)."""
    monkeypatch.chdir(tmp_path)
    found = _readme_commands()
    assert invoke(*found["attnstep generate"][1:]).exit_code == 0
    return found


def _check(command, report):
    """The README's check (and --json REPORT); (click result, report). Its --name options name
    the files the example wrote, head 0 to 3."""
    names = dict(command[i + 1].split("=", 1) for i, arg in enumerate(command) if arg == "--name")
    out = command[command.index("--out") + 1]
    assert set(names) == {"QK", "attention_weights", "output"}
    assert all((Path(out) / pattern.format(i=i)).is_file() for pattern in names.values() for i in range(4)), names
    result = invoke(*command[1:], "--json", report)
    return result, json.loads(report.read_text())


def test_the_readme_example_passes_as_shown(commands, tmp_path):
    program = commands["python3 examples/my_attention.py"]
    assert _run_example(program).stdout.strip() == commands["example prints"]
    result, report = _check(commands["attnstep check"], tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert report["passed"] and [s["stage"] for s in report["stages"]] == ["QK", "attention_weights", "output"]
    assert result.output.splitlines()[-1].startswith("PASS (bounds for fp32): all 3 stages x 4 heads")


def test_the_readme_examples_bug_is_named(commands, tmp_path):
    _run_example(commands["python3 examples/my_attention.py"], "--bug")
    result, report = _check(commands["attnstep check"], tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert report["first_failing_stage"] == "attention_weights"
    assert [d["code"] for d in report["first_failure"]["diagnosis"]][0] == "softmax_axis"
    assert ("diagnosis softmax_axis: attention_weights normalized along the wrong axis: exp(S − row max) divided by "
            "its column sums") in result.output
    statuses = {s["stage"]: s["status"] for s in report["stages"]}
    assert statuses == {"QK": "PASS", "attention_weights": "FAIL", "output": "INHERITED"}
