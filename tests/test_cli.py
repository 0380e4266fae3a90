"""The Click CLI, through CliRunner: exit statuses, messages, reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from verify.cli.group import cli
from verify.files.case import crc32_hex, read_matrix, write_matrix
from verify.stages import UNFINISHED_MARKER

SMALL = ["--heads", "2", "--seq-q", "9", "--seq-k", "13", "--d-k", "16", "--d-v", "16"]


def _one_line_error(result, code=2):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.output.strip().splitlines()[-1]


def test_generate_writes_case_and_manifest(runner, tmp_path):
    res = runner.invoke(cli, ["generate", "--out", str(tmp_path / "c"), *SMALL, "--causal", "--seed", "4"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "c" / "manifest.toml").read_text().count("causal = true") == 1
    assert read_matrix(tmp_path / "c" / "K_head_1.txt").shape == (13, 16)


@pytest.mark.parametrize("option, value", [("--d-k", "0"), ("--d-k", "300"), ("--d-v", "257")])
def test_generate_rejects_bad_dims(runner, tmp_path, option, value):
    res = runner.invoke(cli, ["generate", "--out", str(tmp_path / "case"), option, value])
    assert res.exit_code == 2 and option in res.output and "d_k" not in res.output, res.output
    assert not (tmp_path / "case").exists()


_LONG = "x" * 300  # past any file system's limit on one name (255 bytes)


@pytest.mark.parametrize("args", [
    ["generate", "--out", "{tmp}/" + _LONG, *SMALL], ["check", "--in", "{tmp}/" + _LONG],
    ["check", "--in", "{case}", "--out", "{tmp}/" + _LONG],
    ["check", "--in", "{case}", "--out", "{tmp}/out", "--name", "output=" + _LONG + "{{i}}.txt"],
], ids=["generate-out", "check-in", "check-out", "check-name"])
def test_a_name_too_long_is_one_line(runner, tmp_path, args):
    """A path or a file-name pattern the file system cannot name: one line with the system's reason,
    exit 2, never a traceback."""
    case = tmp_path / "case"
    assert runner.invoke(cli, ["generate", "--out", str(case), *SMALL]).exit_code == 0
    (tmp_path / "out").mkdir()
    res = runner.invoke(cli, [a.format(tmp=tmp_path, case=case) for a in args])
    assert "name too long" in _one_line_error(res).lower() and res.exit_code == 2, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case", "out"]


@pytest.mark.parametrize("args", [
    ["generate", "--out", "", *SMALL], ["run", "--out", "", "--backend", "cpu"],
    ["run", "--in", "", "--backend", "cpu"],
    ["check", "--in", ""], ["check", "--out", ""], ["check", "--json", ""], ["check", "--junit", ""],
], ids=["generate-out", "run-out", "run-in", "check-in", "check-out", "check-json", "check-junit"])
def test_an_empty_path_is_refused_and_nothing_is_written(runner, tmp_path, monkeypatch, args):
    """An empty path (an unset shell variable) would be the working directory: refused in one line
    naming the option, and nothing written there."""
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(cli, args)
    assert "an empty path (name a file or folder)" in _one_line_error(res) and args[1] in res.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, words", [
    (["--in", "", "--out", "o"], "--in: an empty path (name a folder)"),
    (["--out", ""], "--out: an empty path (name a folder)"),
    (["--out=", "--backend", "cpu"], "--out: an empty path (name a folder)"),
    ([""], "an empty argument (name a CASE, or leave it out)"),
])
def test_the_binary_refuses_an_empty_path_and_writes_nothing(binary, tmp_path, args, words):
    ran = subprocess.run([str(binary), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2 and words in ran.stderr, ran.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, before", [("--seqlens", []), ("--seqlens-k", ["--seqlens", "3,4"]),
                                            ("--seqused-k", ["--seqlens", "3,4", "--seqlens-k", "3,4"]),
                                            ("--random-seqlens", [])])
def test_an_empty_packing_option_is_refused_not_taken_for_none(runner, tmp_path, option, before):
    res = runner.invoke(cli, ["generate", "--out", str(tmp_path / "c"), "--heads", "2", "--d-k", "16", "--d-v", "16",
                              *before, option, ""])
    assert _one_line_error(res) == f"Error: Invalid value for '{option}': empty; give its value or leave {option} out"
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("option", ["--stages", "--sanitize"])
def test_run_with_an_empty_list_is_refused_before_anything_moves(runner, good_run, binary, option):
    """An empty --stages (or --sanitize) is refused, not taken for every stage (no sanitizer), and
    before the earlier run is moved aside: the folder still checks."""
    in_dir, out_dir = good_run
    res = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                              "--binary", str(binary), option, ""])
    assert _one_line_error(res) == f"Error: Invalid value for '{option}': empty; give its value or leave {option} out"
    assert runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)]).exit_code == 0


def test_check_help_fits_a_screen_and_points_to_the_tolerance_model(runner):
    res = runner.invoke(cli, ["check", "--help"])
    assert res.exit_code == 0
    assert len(res.output.splitlines()) <= 45, res.output
    assert "docs/tolerances.md" in res.output and "2^-24" not in res.output


def test_check_help_names_every_option_it_does_not_list(runner):
    """The options left out of the list (so that it fits a screen) are named in the description."""
    from verify.cli.check import check as check_command
    text = " ".join(runner.invoke(cli, ["check", "--help"]).output.split())
    hidden = [o for p in check_command.params if getattr(p, "hidden", False) for o in p.opts + p.secondary_opts]
    assert hidden and [o for o in hidden if o not in text] == []


def test_a_command_loads_its_own_modules_alone():
    """`check` runs without importing what `bench` needs (nor the reverse's own), and the group's
    help still lists every command."""
    code = ("import sys; from click.testing import CliRunner; from verify.cli.group import cli, COMMANDS; "
            "r = CliRunner().invoke(cli, ['check', '--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules if m.startswith('verify.cli.') or m.startswith('verify.bench'))); "
            "r = CliRunner().invoke(cli, ['--help']); assert all(c in r.output for c in COMMANDS), r.output")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout
    assert "verify.cli.check" in loaded and "verify.cli.bench" not in loaded and "verify.bench" not in loaded, loaded


def test_check_without_a_run_is_a_one_line_error(runner, tmp_path):
    runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL])
    (tmp_path / "out").mkdir()
    line = _one_line_error(runner.invoke(cli, ["check", "--in", str(tmp_path / "in"),
                                                "--out", str(tmp_path / "out")]))
    assert "no stage files" in line and "--name" in line


def test_check_rejects_bad_tol(runner, tmp_path):
    res = runner.invoke(cli, ["check", "--tol", "QKX=1e-3"])
    assert res.exit_code == 2 and "--tol" in res.output


def test_run_reports_binary_input_errors(runner, tmp_path, binary):
    runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL])
    (tmp_path / "in" / "V_head_1.txt").write_text("1 2\n")
    line = _one_line_error(runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--binary", str(binary),
                                               "--out", str(tmp_path / "out"), "--backend", "cpu"]))
    assert "V_head_1.txt" in line


@pytest.fixture
def good_run(runner, tmp_path, binary):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    assert runner.invoke(cli, ["generate", "--out", str(in_dir), *SMALL]).exit_code == 0
    res = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                              "--binary", str(binary)])
    assert res.exit_code == 0, res.output
    return in_dir, out_dir


def _plant(out_dir, name, mutate):
    """Rewrites one stage file and its CRC in run.toml, as a buggy binary would have written it."""
    path = out_dir / name
    header = path.read_bytes().split(b"\n", 1)[0].decode()
    mat = mutate(read_matrix(path))
    write_matrix(path, mat, "txt", header=header[2:])
    manifest = out_dir / "run.toml"
    lines = []
    for line in manifest.read_text().splitlines():
        if line.startswith(f"crc32_{name.rsplit('.', 1)[0]} "):
            line = f'crc32_{name.rsplit(".", 1)[0]} = "{crc32_hex(path.read_bytes())}"'
        lines.append(line)
    manifest.write_text("\n".join(lines) + "\n")


def test_check_passes_with_json_and_junit(runner, good_run, tmp_path):
    in_dir, out_dir = good_run
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir),
                              "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")])
    assert res.exit_code == 0, res.output
    assert "PASS (bounds for fp32): all" in res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] is True and rep["first_failing_stage"] is None
    entry = rep["results"][0]
    for key in ("stage", "head", "passed", "max_abs", "max_rel", "tol_used", "worst", "diagnosis"):
        assert key in entry
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0" and int(suite.get("tests")) == len(rep["results"])


def test_the_error_maps_of_a_causal_run_compute_no_nan(runner, binary, tmp_path):
    """A masked score is −inf on both sides: its ratio is 0, not 0·inf (a warning, and a NaN that
    the map drew as failing)."""
    pytest.importorskip("matplotlib")
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    assert runner.invoke(cli, ["generate", "--out", str(in_dir), *SMALL, "--causal"]).exit_code == 0
    subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu", "--scale", "1"],
                   check=True, capture_output=True)
    (out_dir / "run.toml").unlink()  # (read as another program's files, whose scale is left out)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--plot", str(tmp_path / "p")])
    assert res.exit_code == 1 and not isinstance(res.exception, RuntimeWarning), (res.exception, res.output)
    assert "wrote" in res.output and "error map" in res.output, res.output


def test_check_names_first_failing_stage_and_writes_plots(runner, good_run, tmp_path):
    in_dir, out_dir = good_run
    _plant(out_dir, "QK_head_1.txt", lambda m: m * 2.0)
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir),
                              "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots")])
    assert res.exit_code == 1, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["first_failing_stage"] == "QK"
    assert "first failing stage: QK (head 1" in res.output
    assert (tmp_path / "plots" / "QK_head_1.png").stat().st_size > 1000


@pytest.mark.parametrize("value", ["-5", "99999999999"])
def test_a_flash_tile_out_of_range_in_run_toml_is_one_line(runner, good_run, value):
    in_dir, out_dir = good_run
    manifest = out_dir / "run.toml"
    manifest.write_text(manifest.read_text().replace("flash_block_q = ", f"flash_block_q = {value}\n#", 1))
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)])
    assert f"run.toml: flash_block_q = {value}: a flash tile of 0..16777216 (0: no flash stage ran)" in \
        _one_line_error(res)


def test_the_diagnoses_try_a_runs_own_key_tile_only_as_wide_as_a_kernels():
    """A key tile wider than any kernel's (run.toml may say up to 2^24) would extend the keys by
    that many in the keys-past-the-end diagnosis: the usual widths are tried instead."""
    from types import SimpleNamespace

    from verify.diagnose.base import KEY_TILES, MAX_RUN_KEY_TILE
    from verify.diagnose.inputs import key_tiles
    assert key_tiles(SimpleNamespace(flash_tiles=(64, 96))) == [96, *KEY_TILES]
    assert key_tiles(SimpleNamespace(flash_tiles=(64, MAX_RUN_KEY_TILE + 1))) == list(KEY_TILES)
    assert key_tiles(SimpleNamespace(flash_tiles=(64, 10**7))) == list(KEY_TILES)


def test_stale_file_is_refused(runner, good_run, tmp_path):
    in_dir, out_dir = good_run
    path = out_dir / "output_head_0.txt"
    path.write_bytes(path.read_bytes().replace(b"\n", b" \n", 2))  # same numbers, another file
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json",
                              str(tmp_path / "r.json")])
    assert res.exit_code == 1
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["first_failure"]["status"] == "STALE"
    assert rep["first_failure"]["diagnosis"][0]["code"] == "stale"


def test_tolerance_override_can_fail_a_correct_run(runner, good_run):
    in_dir, out_dir = good_run
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--tol", "QK=0"])
    # a float32 GEMM against float64 is not exact: a zero tolerance must fail QK
    assert res.exit_code == 1 and "first failing stage: QK" in res.output


def test_demo_runs_the_default_case(runner, tmp_path, binary):
    res = runner.invoke(cli, ["demo", "--data-dir", str(tmp_path), "--backend", "cpu",
                              "--binary", str(binary)])
    assert res.exit_code == 0, res.output
    assert "12 heads" in res.output and "PASS" in res.output


def test_demo_with_the_backward_pass_checks_the_gradients(runner, tmp_path, binary):
    res = runner.invoke(cli, ["demo", "--data-dir", str(tmp_path), "--backend", "cpu",
                              "--binary", str(binary), "--backward"])
    assert res.exit_code == 0, res.output
    assert "with the output gradient dO" in res.output
    for stage in ("dQ", "dK", "dV", "flash_dQ"):
        assert f"\n{stage} " in res.output, stage
    from verify.stages import BACKWARD_STAGES, FORWARD_STAGES
    assert f"PASS (bounds for fp32): all {len(FORWARD_STAGES + BACKWARD_STAGES)} stages" in res.output


def test_python_dash_m_verify(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "verify", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout and "check" in out.stdout


@pytest.mark.parametrize("args, words", [
    (["check", "--names", "nosuch.toml"], "Invalid value for '--names': File 'nosuch.toml' does not exist. "
                                          "(see attnstep check --help)"),
    (["check", "--name", "output"], "expected STAGE=PATTERN"),
    (["--bogus"], "No such option '--bogus'. (see attnstep --help)"),
    (["nosuchcommand"], "No such command 'nosuchcommand'."),
])
def test_a_usage_error_is_one_line_naming_the_help(tmp_path, args, words):
    out = subprocess.run([sys.executable, "-m", "verify", *args], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert out.returncode == 2 and out.stdout == "", out
    assert len(out.stderr.strip().splitlines()) == 1 and words in out.stderr, out.stderr


def test_seed_scripts_run_the_same_code(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(repo / "scripts" / "generate.py"), "--out",
                          str(tmp_path / "c"), *SMALL], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, str(repo / "scripts" / "verify.py"), "--in", str(tmp_path / "c"),
                          "--out", str(tmp_path / "none")], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [["--atol", "nan"], ["--rtol", "-1"], ["--tol", "QK=nan"],
                                  ["--tol", "QK=1e-3,inf"]], ids=["atol-nan", "rtol-neg", "tol-nan", "tol-inf"])
def test_check_rejects_nonfinite_tolerances(runner, args):
    res = runner.invoke(cli, ["check", *args])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_run_timeout_stops_the_binary_and_leaves_no_case(runner, tmp_path, binary):
    runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), "--heads", "8", "--seq-q", "700",
                        "--seq-k", "700", "--d-k", "64", "--d-v", "64"])
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                              "--backend", "cpu", "--binary", str(binary), "--timeout", "1"])
    assert res.exit_code == 1 and "--timeout" in res.output, res.output
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert left == [UNFINISHED_MARKER], left  # SIGTERM: the binary stopped, its staged files removed
    res = runner.invoke(cli, ["check", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "did not finish" in res.output and "--timeout" in res.output, res.output


def test_binary_option_takes_relative_paths(runner, tmp_path, binary, monkeypatch):
    runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "main").symlink_to(binary)
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(cli, ["run", "--in", "in", "--out", "out", "--backend", "cpu", "--binary", "bin/main"])
    assert res.exit_code == 0, res.output


def test_check_fails_a_run_that_ignored_the_input_manifest(runner, good_run, tmp_path):
    """The verdict follows the input case: outputs computed without the mask that the manifest asks
    for fail, naming the mismatch; the command line can say what to check instead."""
    in_dir, out_dir = good_run
    manifest = in_dir / "manifest.toml"
    manifest.write_text(manifest.read_text().replace("causal = false", "causal = true"))
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    assert "the run computed causal = false (run.toml) but the input case asks for causal = true" in res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mismatches"] and report["first_failing_stage"] == "QK_scaled"
    assert report["first_failure"]["diagnosis"][0]["code"] == "causal_mismatch"
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--no-causal"])
    assert res.exit_code == 0, res.output


def test_check_fails_a_run_of_another_scale_than_the_input_case_asks_for(runner, good_run, tmp_path):
    """The scale as the mask: the input case decides, a run of another scale fails with
    scale_mismatch, and --scale says what to check instead."""
    in_dir, out_dir = good_run
    manifest = in_dir / "manifest.toml"
    manifest.write_text(manifest.read_text() + "scale = 0.5\n")  # the run used 1/sqrt(16) = 0.25
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    assert "the run computed scale = 0.25 (run.toml) but the input case asks for scale = 0.5" in res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_failing_stage"] == "QK_scaled"
    assert report["first_failure"]["diagnosis"][0]["code"] == "scale_mismatch"
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--scale", "0.25"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("stages", ["output", "QK_scaled,flash_lse", "attention_weights"])
def test_a_partial_run_checks_without_its_upstream_stages(runner, tmp_path, binary, stages):
    """run --stages S writes S alone: check verifies it from the inputs, with no upstream file."""
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    assert runner.invoke(cli, ["generate", "--out", str(in_dir), *SMALL, "--causal"]).exit_code == 0
    res = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                              "--binary", str(binary), "--stages", stages])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert [s["stage"] for s in json.loads((tmp_path / "r.json").read_text())["stages"]] == stages.split(",")


def test_check_of_a_stage_the_run_did_not_write_is_an_error(runner, tmp_path, binary):
    runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL])
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                              "--backend", "cpu", "--binary", str(binary), "--stages", "QK"])
    assert res.exit_code == 0, res.output
    line = _one_line_error(runner.invoke(cli, ["check", "--in", str(tmp_path / "in"), "--out",
                                               str(tmp_path / "out"), "--stage", "output"]))
    assert "--stage output" in line and "holds no output" in line


# ---- what check writes: never over something that is not a regular file -----------------------

def _fifo(path):
    import os
    os.mkfifo(path)
    return path


def _is_fifo(path):
    import os
    import stat
    return stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("option", ["--json", "--junit", "--plot"])
def test_check_refuses_a_fifo_as_report_path_before_checking(runner, good_run, tmp_path, option):
    in_dir, out_dir = good_run
    _plant(out_dir, "QK_head_1.txt", lambda m: m * 2.0)  # a failing run: --plot writes too
    fifo = _fifo(tmp_path / "pipe")
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), option, str(fifo)])
    line = _one_line_error(res)
    assert option in line and "is a FIFO" in line
    assert "attnstep check:" not in res.output  # refused before the comparison ran
    assert _is_fifo(fifo)


def test_check_refuses_a_link_to_a_fifo_and_a_folder(runner, good_run, tmp_path):
    in_dir, out_dir = good_run
    (tmp_path / "link").symlink_to(_fifo(tmp_path / "pipe"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder_link").symlink_to(tmp_path / "folder")
    for path in ("link", "folder", "folder_link"):
        res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json",
                                  str(tmp_path / path)])
        assert "--json" in _one_line_error(res)
    assert (tmp_path / "link").is_symlink() and _is_fifo(tmp_path / "pipe")
    assert (tmp_path / "folder_link").is_symlink() and not list((tmp_path / "folder").iterdir())


def _special_path(tmp_path, kind):
    """A report path that must be refused, and what it is."""
    import os
    if kind == "device":
        return Path("/dev/null")
    if kind == "fifo":
        return _fifo(tmp_path / "pipe")
    if kind == "folder":
        (tmp_path / "folder").mkdir()
        return tmp_path / "folder"
    if kind == "file":
        (tmp_path / "file").write_text("keep\n")
        return tmp_path / "file"
    if kind == "link-to-device":
        os.symlink("/dev/full", tmp_path / "link")
        return tmp_path / "link"
    return Path("/proc/attnstep-report")  # unwritable: no file can be created there, not even by root


REFUSED = [(opt, kind) for opt in ("--json", "--junit", "--plot")
           for kind in ("device", "fifo", "folder", "file", "link-to-device", "unwritable")
           if (kind == "file") == (opt == "--plot") or kind not in ("folder", "file")]


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("option,kind", REFUSED, ids=[f"{o[2:]}-{k}" for o, k in REFUSED])
def test_check_refuses_a_report_path_in_one_line_before_checking(runner, good_run, tmp_path, option, kind):
    """Each: one line naming the option and the path, exit 2, before any comparison ran, and what
    was there is still there as it was."""
    import os
    in_dir, out_dir = good_run
    _plant(out_dir, "QK_head_1.txt", lambda m: m * 2.0)  # a failing run: --plot writes too
    path = _special_path(tmp_path, kind)
    before = os.lstat(path) if os.path.lexists(path) else None
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), option, str(path)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {option} {path}: "), res.output
    if before is None:
        assert not os.path.lexists(path)
    else:
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino, after.st_size) == (before.st_mode, before.st_ino, before.st_size)


def test_check_writes_reports_through_a_symlink(runner, good_run, tmp_path):
    in_dir, out_dir = good_run
    (tmp_path / "reports").mkdir()
    target = tmp_path / "reports" / "r.json"
    target.write_text("old\n")
    (tmp_path / "r.json").symlink_to(target)
    (tmp_path / "r.xml").symlink_to(tmp_path / "reports" / "r.xml")  # not there yet
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json",
                              str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r.json").is_symlink() and (tmp_path / "r.xml").is_symlink()
    assert json.loads(target.read_text())["passed"] is True
    assert ET.parse(tmp_path / "reports" / "r.xml").getroot().tag == "testsuites"
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["r.json", "r.xml"]  # no temporaries


def test_check_refuses_a_report_in_a_missing_folder_before_checking(runner, good_run, tmp_path):
    in_dir, out_dir = good_run
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--junit",
                              str(tmp_path / "nowhere" / "r.xml")])
    line = _one_line_error(res)
    assert "--junit" in line and "does not exist" in line and "attnstep check:" not in res.output


# ---- generate replaces only what it wrote ------------------------------------------------------

def _own_case(folder):
    folder.mkdir()
    for name in ("Q", "K", "V"):
        (folder / f"{name}_head_0.txt").write_text("1 2\n3 4\n")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_generate_refuses_to_replace_a_users_case(runner, tmp_path):
    before = _own_case(tmp_path / "mine")
    line = _one_line_error(runner.invoke(cli, ["generate", "--out", str(tmp_path / "mine"), *SMALL]))
    assert str(tmp_path / "mine") in line and "--force" in line
    assert {p.name: p.read_bytes() for p in (tmp_path / "mine").iterdir()} == before
    (tmp_path / "mine" / "manifest.toml").write_text("heads = 1\n")  # a manifest attnstep did not write
    _one_line_error(runner.invoke(cli, ["generate", "--out", str(tmp_path / "mine"), *SMALL]))
    assert (tmp_path / "mine" / "Q_head_0.txt").read_bytes() == before["Q_head_0.txt"]


def test_generate_force_replaces_a_users_case(runner, tmp_path):
    _own_case(tmp_path / "mine")
    res = runner.invoke(cli, ["generate", "--out", str(tmp_path / "mine"), *SMALL, "--force"])
    assert res.exit_code == 0, res.output
    assert read_matrix(tmp_path / "mine" / "Q_head_1.txt").shape == (9, 16)


def test_demo_refuses_a_users_case_without_force(runner, tmp_path, binary):
    before = _own_case(tmp_path / "random_test")
    line = _one_line_error(runner.invoke(cli, ["demo", "--data-dir", str(tmp_path), "--backend", "cpu",
                                               "--binary", str(binary)]))
    assert "--force" in line
    assert {p.name: p.read_bytes() for p in (tmp_path / "random_test").iterdir()} == before


# ---- seeds: what NumPy and the manifest readers take -------------------------------------------

@pytest.mark.parametrize("seed", ["-1", str(2**63), "99999999999999999999999"])
def test_generate_rejects_seeds_out_of_range(runner, tmp_path, seed):
    res = runner.invoke(cli, ["generate", "--out", str(tmp_path / "c"), *SMALL, "--seed", seed])
    assert "--seed" in _one_line_error(res)
    assert not (tmp_path / "c").exists()


def test_generate_largest_seed_is_read_back_by_both_readers(runner, tmp_path, binary):
    from verify.files.case import load_input_case
    res = runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL, "--seed", str(2**63 - 1)])
    assert res.exit_code == 0, res.output
    assert load_input_case(tmp_path / "in").dims.heads == 2
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                              "--backend", "cpu", "--binary", str(binary), "--stages", "Q"])
    assert res.exit_code == 0, res.output


# ---- non-finite inputs, accepted on purpose ----------------------------------------------------

@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_check_allow_nonfinite_follows_run_allow_nonfinite(runner, tmp_path, binary, value):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    assert runner.invoke(cli, ["generate", "--out", str(in_dir), *SMALL]).exit_code == 0
    q = read_matrix(in_dir / "Q_head_1.txt")
    q[3, 2] = value
    write_matrix(in_dir / "Q_head_1.txt", q, "txt")
    res = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                              "--binary", str(binary), "--allow-nonfinite"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--allow-nonfinite",
                              "--json", str(tmp_path / "r.json")])
    assert res.exit_code in (0, 1) and "Traceback" not in res.output, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    # NaN rows where the reference has them pass; the log-sum-exp of a non-finite row is left to
    # the comparison (the CPU backend writes -inf or NaN there where the reference has NaN or +inf:
    # a failure the report names)
    failed = [s["stage"] for s in rep["stages"] if not s["passed"]]
    assert failed in ([], ["flash_lse"]), res.output
    if failed:
        assert "FAIL flash_lse head 1" in res.output and "first mismatches: [3,0]" in res.output
    out = next(r for r in rep["results"] if r["stage"] == "output" and r["head"] == 1)
    assert out["worst"]["row"] != 3
    line = _one_line_error(runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)]))
    assert "Q_head_1.txt" in line and "--allow-nonfinite" in line
    assert "--allow-nonfinite" in runner.invoke(cli, ["check", "--help"]).output


def test_check_allow_nonfinite_still_fails_nan_where_the_reference_is_finite(runner, good_run):
    in_dir, out_dir = good_run
    _plant(out_dir, "output_head_0.txt", lambda m: np.where(np.arange(m.size).reshape(m.shape) == 5,
                                                            np.nan, m))
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--allow-nonfinite"])
    assert res.exit_code == 1 and "first failing stage: output (head 0" in res.output, res.output


# ---- the binary's error, said once -------------------------------------------------------------

def test_run_says_the_binary_error_once(runner, tmp_path, binary):
    runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL])
    (tmp_path / "in" / "V_head_1.txt").write_text("1 2\n")
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--binary", str(binary),
                              "--out", str(tmp_path / "out"), "--backend", "cpu"])
    line = _one_line_error(res)
    assert res.output.count("V_head_1.txt") == 1, res.output
    assert "HINT:" in line and res.output.count("HINT:") == 1  # the binary's hint, on the same line
    assert line.startswith("Error: ") and "main: error:" not in line, line  # (its own prefix once: "Error: ")


def test_a_program_that_fails_silently_is_named_by_its_file(runner, tmp_path):
    """`run --binary` of a user's program that exits non-zero and says nothing: named, not "the binary"."""
    runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL])
    program = tmp_path / "my_kernel.sh"
    program.write_text("#!/bin/sh\nexit 5\n")
    program.chmod(0o755)
    line = _one_line_error(runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--binary", str(program),
                                               "--out", str(tmp_path / "out")]), code=1)
    assert line == "Error: my_kernel.sh exited with status 5", line


def test_run_on_a_terminal_shows_the_binarys_progress(runner, tmp_path, binary, monkeypatch):
    """On a terminal, `run` asks the binary it built for progress reports and draws a bar from
    them; the report lines themselves never reach the user."""
    import verify.cli.run
    import verify.terminal
    monkeypatch.setattr(verify.cli.run, "_build", lambda build_dir, quiet: binary)
    monkeypatch.setattr(verify.terminal, "on_terminal", lambda: True)
    monkeypatch.setattr(verify.terminal, "RUN_PROGRESS_AFTER_S", 0.0)
    seen = []
    real_bar = verify.terminal.click.progressbar
    monkeypatch.setattr(verify.terminal.click, "progressbar",
                        lambda **kw: seen.append(kw["length"]) or real_bar(**kw))
    assert runner.invoke(cli, ["generate", "--out", str(tmp_path / "in"), *SMALL]).exit_code == 0
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                              "--backend", "cpu"])
    assert res.exit_code == 0, res.output
    assert seen == [2 * (2 + 10)]  # 2 heads x (read + compute + 10 stage files)
    assert "main: progress" not in res.output and "10 stages; written to" in res.output
    quiet = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                                "--backend", "cpu", "--quiet"])
    assert quiet.exit_code == 0 and seen == [24]


def test_a_check_of_nonfinite_inputs_prints_no_numpy_warnings(runner, tmp_path, binary):
    """A bias file changed to -inf along a row after the run (its scores then disagree): the check
    fails and names the stage, and NumPy's warnings about the infinities stay out of its output."""
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    small = ["--heads", "2", "--seq-q", "8", "--seq-k", "8", "--d-k", "16", "--d-v", "16"]
    assert runner.invoke(cli, ["generate", "--out", str(in_dir), *small, "--bias", "random"]).exit_code == 0
    assert subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu"],
                          capture_output=True).returncode == 0
    bias = in_dir / "bias.txt"
    lines = bias.read_text().splitlines()
    bias.write_text("\n".join([lines[0], " ".join(["-inf"] * 8), *lines[2:]]) + "\n")
    res = subprocess.run([sys.executable, "-m", "verify", "check", "--in", str(in_dir), "--out", str(out_dir),
                          "--quiet"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "first failing stage" in res.stdout + res.stderr, res.stdout + res.stderr
    assert "Warning" not in res.stderr, res.stderr


@pytest.mark.parametrize("command", [["bench"], ["sweep"], ["run", "--backend", "cpu"], ["demo"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_timeout_that_is_not_a_finite_number_is_refused(runner, tmp_path, monkeypatch, command, value):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(cli, [*command, "--timeout", value])
    assert f"'--timeout': {value} is not a finite number of seconds" in _one_line_error(res)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["bench"], ["sweep", "--d", "16", "--seq", "128"], ["bench", "--decode", "goals"]],
                         ids=["bench", "sweep", "decode"])
def test_a_binary_that_cannot_be_run_is_one_line(runner, tmp_path, command):
    plain = tmp_path / "main"
    plain.write_text("not a program\n")  # (not executable)
    res = runner.invoke(cli, [*command, "--binary", str(plain)])
    assert _one_line_error(res) == f"Error: cannot run {plain}: Permission denied; HINT: is it executable (chmod +x)?"
