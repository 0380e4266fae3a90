"""The verifier never touches or leaks what is not its own: the input case and the output folder
kept apart, reports never written over a file the check reads, `run` leaving another case's
inputs and a user's own files where they are, plots never written through a planted link, no
FIFO or kernel file read, and no control character from a file reaching a terminal or a report.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers.cli import invoke
from verify.files.case import CaseError, read_bytes, read_matrix, write_matrix
from verify.files.outputs import stage_files_in
from verify.stages import parse_stage_file
from verify.text import printable

SMALL = ["--heads", "2", "--seq-q", "9", "--seq-k", "13", "--d-k", "16", "--d-v", "16"]
# What no line shown or reported may hold: C0 controls but the line end, DEL, C1 controls.
CONTROLS = [chr(c) for c in (*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0))]


def one_line_error(result, code=2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


def no_controls(text: str) -> bool:
    return not any(ch in text for ch in CONTROLS)


@pytest.fixture
def good_run(tmp_path, binary):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    assert invoke("generate", "--out", in_dir, *SMALL).exit_code == 0
    res = invoke("run", "--in", in_dir, "--out", out_dir, "--backend", "cpu", "--binary", binary)
    assert res.exit_code == 0, res.output
    return in_dir, out_dir


def _foreign(out_dir: Path) -> None:
    """The run as another program's output: no run.toml (files are parsed, not CRC-checked)."""
    (out_dir / "run.toml").unlink()


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _snapshot(folder: Path):
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))}


# ---- 1. check: the input case and the output folder apart ---------------------------------------

@pytest.mark.parametrize("layout", ["same", "link", "out-inside-in", "in-inside-out"])
def test_check_refuses_an_output_folder_that_is_or_overlaps_the_input_case(tmp_path, good_run, layout):
    in_dir, out_dir = good_run
    if layout == "same":
        args, words = (in_dir, in_dir), "are the same folder"
    elif layout == "link":
        (tmp_path / "link").symlink_to(in_dir)
        args, words = (in_dir, tmp_path / "link"), "are the same folder"
    elif layout == "out-inside-in":
        shutil.copytree(out_dir, in_dir / "result")
        args, words = (in_dir, in_dir / "result"), f"--out {in_dir / 'result'} is inside --in {in_dir}"
    else:
        shutil.copytree(in_dir, out_dir / "case")
        args, words = (out_dir / "case", out_dir), f"--in {out_dir / 'case'} is inside --out {out_dir}"
    line = one_line_error(invoke("check", "--in", args[0], "--out", args[1]))
    assert words in line and f"--in {args[0]}" in line and f"--out {args[1]}" in line and "HINT:" in line


@pytest.mark.parametrize("layout", ["out-inside-in", "in-inside-out"])
def test_run_refuses_them_before_anything_is_written(tmp_path, good_run, layout):
    """A run into such a folder could never be checked: refused before the program runs."""
    in_dir, _ = good_run
    if layout == "out-inside-in":
        args = (in_dir, in_dir / "result")
    else:
        shutil.copytree(in_dir, tmp_path / "hold" / "case")
        args = (tmp_path / "hold" / "case", tmp_path / "hold")
    before = _snapshot(tmp_path)
    line = one_line_error(invoke("run", "--in", args[0], "--out", args[1], "--backend", "cpu"))
    assert "the input case and the output folder must be apart" in line
    assert _snapshot(tmp_path) == before


# ---- 2. name maps match only the names a program writes ------------------------------------------

def test_name_map_patterns_match_only_head_numbers(tmp_path):
    names = ["O_0.txt", "O_12.txt", "O_2024-notes.txt", "O_-1.txt", "O_+1.txt", "O_01.txt", "O_.txt",
             "O_\u0663.txt", "O_1.txt.bak", "O_1xtxt"]
    for n in names:
        (tmp_path / n).write_text("1\n")
    assert stage_files_in(tmp_path, {"output": "O_{i}.txt"}) == ["O_0.txt", "O_12.txt"]
    assert stage_files_in(tmp_path, {"output": "O_{b}_{h}.txt"}) == []


def test_stage_file_names_take_ascii_head_numbers_only():
    assert parse_stage_file("QK_head_12.txt") == ("QK", 12, "txt")
    assert parse_stage_file("QK_head_\u0663.txt") is None  # an Arabic-Indic three
    assert parse_stage_file("QK_head_\u00b2.txt") is None  # '²': isdigit() but no int()


def test_run_binary_leaves_a_users_files_that_only_look_like_the_pattern(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "O_2024-notes.txt").write_text("my notes\n")
    (out / "O_7.txt").write_text("an earlier run's\n")
    prog = _script(tmp_path / "prog.sh", f'echo 1 > "{out}/O_0.txt"\n')
    res = invoke("run", "--binary", prog, "--out", out, "--name", "output=O_{i}.txt", "--", "x")
    assert res.exit_code == 0, res.output
    assert (out / "O_2024-notes.txt").read_text() == "my notes\n"
    assert (out / ".attnstep-previous" / "O_7.txt").exists()
    assert not (out / ".attnstep-previous" / "O_2024-notes.txt").exists()


# ---- 3. run never moves another case's inputs aside ----------------------------------------------

def test_run_refuses_an_output_folder_holding_another_cases_inputs(tmp_path, binary):
    assert invoke("generate", "--out", tmp_path / "in", *SMALL).exit_code == 0
    other = tmp_path / "other"
    assert invoke("generate", "--out", other, *SMALL, "--seed", "5").exit_code == 0
    (other / "manifest.toml").unlink()  # a case of the user's own: input files only
    before = _snapshot(other)
    line = one_line_error(invoke("run", "--in", tmp_path / "in", "--out", other, "--binary", binary,
                                 "--backend", "cpu"))
    assert line.startswith(f"Error: --out {other}: holds an input case (K_head_0.txt") and "HINT:" in line
    prog = _script(tmp_path / "prog.sh", "exit 0\n")
    one_line_error(invoke("run", "--binary", prog, "--out", other, "--", "x"))
    assert _snapshot(other) == before  # nothing moved


def test_run_still_takes_an_output_folder_that_echoes_the_inputs(tmp_path, good_run, binary):
    in_dir, out_dir = good_run
    _foreign(out_dir)  # another program's output: Q, K, V echoed beside the other stages
    res = invoke("run", "--in", in_dir, "--out", out_dir, "--backend", "cpu", "--binary", binary)
    assert res.exit_code == 0, res.output
    assert (out_dir / ".attnstep-previous" / "Q_head_0.txt").exists() and (out_dir / "run.toml").exists()


# ---- 4. reports never over a file the check reads ------------------------------------------------

REPORT_TARGETS = ["run.toml", "manifest.toml", "input", "stage", "link-to-input", "hard-link-to-stage",
                  "names-file", "mapped-stage"]


@pytest.mark.parametrize("option", ["--json", "--junit"])
@pytest.mark.parametrize("target", REPORT_TARGETS)
def test_a_report_over_a_file_the_check_reads_is_refused_before_checking(tmp_path, good_run, option, target):
    in_dir, out_dir = good_run
    extra = []
    path = {"run.toml": out_dir / "run.toml", "manifest.toml": in_dir / "manifest.toml",
            "input": in_dir / "V_head_1.txt", "stage": out_dir / "QK_head_0.txt",
            "link-to-input": tmp_path / "r.json", "hard-link-to-stage": tmp_path / "r.json",
            "names-file": tmp_path / "names.toml", "mapped-stage": out_dir / "O_1.txt"}[target]
    if target == "link-to-input":
        path.symlink_to(in_dir / "Q_head_0.txt")
    elif target == "hard-link-to-stage":
        os.link(out_dir / "output_head_1.txt", path)
    elif target == "names-file":
        path.write_text('QK = "QK_head_{i}.txt"\n')
        extra = ["--names", path]
    elif target == "mapped-stage":
        _foreign(out_dir)
        for i in range(2):
            os.rename(out_dir / f"output_head_{i}.txt", out_dir / f"O_{i}.txt")
        extra = ["--name", "output=O_{i}.txt"]
    before = _snapshot(tmp_path)
    res = invoke("check", "--in", in_dir, "--out", out_dir, option, path, *extra)
    line = one_line_error(res)
    assert line.startswith(f"Error: {option} ") and "a file this check reads" in line and "HINT:" in line
    assert _snapshot(tmp_path) == before


def test_json_and_junit_on_one_file_is_refused(tmp_path, good_run):
    in_dir, out_dir = good_run
    report = tmp_path / "r.txt"
    line = one_line_error(invoke("check", "--in", in_dir, "--out", out_dir, "--json", report, "--junit", report))
    assert "--json" in line and "--junit" in line and not report.exists()


# ---- 5. plots never written through a planted link -----------------------------------------------

def test_plot_replaces_a_link_planted_at_its_name_and_leaves_the_target(tmp_path, good_run):
    pytest.importorskip("matplotlib")
    in_dir, out_dir = good_run
    path = out_dir / "QK_head_1.txt"
    write_matrix(path, read_matrix(path) * 2.0, "txt")
    _foreign(out_dir)  # no CRC table: the doubled QK is checked, and fails
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "QK_head_1.png").symlink_to(victim)
    res = invoke("check", "--in", in_dir, "--out", out_dir, "--plot", plots)
    assert res.exit_code == 1, res.output
    assert victim.read_bytes() == b"keep\n"
    png = plots / "QK_head_1.png"
    assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG")
    assert not [p for p in plots.iterdir() if ".tmp-" in p.name]


# ---- 6. only regular data files are read ---------------------------------------------------------

def test_a_fifo_is_refused_before_anything_opens_it(tmp_path, no_hang, monkeypatch):
    fifo = tmp_path / "QK_head_0.txt"
    os.mkfifo(fifo)
    (tmp_path / "link.txt").symlink_to(fifo)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    for path in (fifo, tmp_path / "link.txt"):
        with pytest.raises(CaseError, match=r": is a FIFO, not a regular file; HINT:"):
            read_bytes(path, (2, 2))
    assert opened == []


def test_a_folder_is_refused(tmp_path):
    (tmp_path / "m.txt").mkdir()
    with pytest.raises(CaseError, match=r"m.txt: is a folder, not a regular file"):
        read_bytes(tmp_path / "m.txt")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")
def test_a_link_into_proc_is_refused_unread(tmp_path):
    link = tmp_path / "Q_head_0.txt"
    link.symlink_to("/proc/self/environ")
    with pytest.raises(CaseError, match=r"Q_head_0.txt: links to /proc/.*a file of the kernel"):
        read_matrix(link, (2, 2))


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")
def test_a_stage_file_linked_to_the_environment_leaks_none_of_it(tmp_path, good_run):
    in_dir, out_dir = good_run
    _foreign(out_dir)
    (out_dir / "output_head_0.txt").unlink()
    (out_dir / "output_head_0.txt").symlink_to("/proc/self/environ")
    res = invoke("check", "--in", in_dir, "--out", out_dir, "--json", tmp_path / "r.json")
    assert res.exit_code == 1, res.output
    report = (tmp_path / "r.json").read_text()
    secrets = [v for v in Path("/proc/self/environ").read_bytes().decode("latin1").split("\0") if len(v) > 8]
    assert not any(s[:12] in res.output or s[:12] in report for s in secrets)
    failure = json.loads(report)["first_failure"]
    assert failure["stage"] == "output" and "a file of the kernel" in failure["message"]


# ---- 7. strings from files shown with their control characters escaped, and cut ------------------

def test_printable_escapes_controls_and_cuts():
    osc52 = "H100\x1b]52;c;SGVsbG8=\x07\x9b31m\x7f\u202e"
    assert printable(osc52) == "H100\\x1b]52;c;SGVsbG8=\\x07\\x9b31m\\x7f\\u202e"
    assert printable("tab\there\nnew") == "tab\\x09here\\x0anew"
    assert printable("\udcff") == "\\udcff"  # an undecodable byte of a file name
    long = printable("\x1b" * 500)
    assert len(long) <= 120 and long.endswith("...") and long[:-3].replace("\\x1b", "") == ""
    assert printable("ok: é, 中") == "ok: é, 中"


def _edit_run_toml(out_dir: Path, **values) -> None:
    lines = [ln for ln in (out_dir / "run.toml").read_text().splitlines() if ln.split(" = ")[0] not in values]
    (out_dir / "run.toml").write_text("\n".join(lines + [f"{k} = {v}" for k, v in values.items()]) + "\n")


def test_run_toml_strings_reach_no_terminal_or_report_with_their_escapes(tmp_path, good_run):
    in_dir, out_dir = good_run
    # TOML escapes in quoted strings decode to control characters: the file itself is plain ASCII.
    _edit_run_toml(out_dir, device='"H100\\u001b]52;c;SGVsbG8=\\u0007\\u009b31m' + "x" * 300 + '"',
                   run_id='"run\\u001bP1$q\\u001b\\\\\\u0085"')
    stale = out_dir / "output_head_0.txt"
    stale.write_bytes(stale.read_bytes().replace(b"\n", b" \n", 2))  # its failure message quotes the run id
    res = invoke("check", "--in", in_dir, "--out", out_dir, "--json", tmp_path / "r.json",
                 "--junit", tmp_path / "r.xml")
    assert res.exit_code == 1, res.output
    assert no_controls(res.output) and "H100\\x1b]52;c;SGVsbG8=\\x07\\x9b31m" in res.output
    assert max(len(line) for line in res.output.splitlines()) < 400  # the 300 x's cut
    rep = json.loads((tmp_path / "r.json").read_text())
    assert no_controls(rep["device"]) and len(rep["device"]) <= 120 and no_controls(rep["run_id"])
    assert rep["first_failure"]["status"] == "STALE" and no_controls(json.dumps(rep, ensure_ascii=False))
    failures = [f.get("message") for f in ET.parse(tmp_path / "r.xml").getroot().iter("failure")]
    assert failures and all(no_controls(m) for m in failures)
    assert any("run\\x1bP1$q" in m for m in failures)


@pytest.mark.parametrize("line", ['precision = "' + "\\u001b" * 3000 + '"', 'backend = "' + "y" * 5000 + '"'])
def test_a_long_or_escaped_run_toml_value_is_one_short_line(good_run, line):
    in_dir, out_dir = good_run
    key = line.split(" = ")[0]
    _edit_run_toml(out_dir, **{key: line.split(" = ", 1)[1]})
    err = one_line_error(invoke("check", "--in", in_dir, "--out", out_dir))
    assert no_controls(err) and len(err) < 400 and f"{key} = " in err


def test_a_names_file_pattern_with_control_characters_is_refused_escaped(tmp_path, good_run):
    in_dir, out_dir = good_run
    names = tmp_path / "names.toml"
    names.write_text('output = "O_\\u001b]52;c;eA==\\u0007{i}.txt"\n')
    err = one_line_error(invoke("check", "--in", in_dir, "--out", out_dir, "--names", names))
    assert no_controls(err) and "control characters in a file name" in err and "\\x1b]52" in err


@pytest.mark.parametrize("content, words", [
    (b"output = [\n", "names.toml: not a valid names file ("),
    (b"output = \"O_\xe9{i}.txt\"\n", "names.toml:1:13: byte 0xE9 in the names file (ASCII text only)"),
], ids=["not-toml", "not-ascii"])
def test_a_broken_names_file_is_called_a_names_file(tmp_path, good_run, content, words):
    in_dir, out_dir = good_run
    names = tmp_path / "names.toml"
    names.write_bytes(content)
    err = one_line_error(invoke("check", "--in", in_dir, "--out", out_dir, "--names", names))
    assert words in err and "manifest" not in err, err


def test_a_bare_pattern_in_a_names_file_is_told_to_quote_it(tmp_path, good_run):
    in_dir, out_dir = good_run
    names = tmp_path / "names.toml"
    names.write_text("output = O_{i}.txt\n")
    err = one_line_error(invoke("check", "--in", in_dir, "--out", out_dir, "--names", names))
    assert "not a valid names file" in err and 'the pattern in double quotes' in err, err
