"""Input cases with the output gradient dO: `attnstep generate --backward`, and reading them
(verify/files/case.py) with the same rules as the binary."""
from __future__ import annotations

import tomllib

import numpy as np
import pytest
from click.testing import CliRunner

from verify.cli.group import cli
from verify.files.case import CaseError, load_input_case, read_matrix
from verify.stages import GRAD_INPUT, INPUT_MANIFEST, INPUT_NAMES, STAGES, Dims, stage_file

DIMS = Dims(batch=2, heads=2, seq_q=7, seq_k=13, d_k=16, d_v=24)
DIM_ARGS = ["--batch", "2", "--heads", "2", "--seq-q", "7", "--seq-k", "13", "--d-k", "16", "--d-v", "24"]


def generate(folder, *extra):
    res = CliRunner().invoke(cli, ["generate", "--out", str(folder), *DIM_ARGS, "--seed", "5", *extra])
    assert res.exit_code == 0, res.output
    return folder


def _one_line_error(res):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    return res.output.strip().splitlines()[-1]


@pytest.mark.parametrize("fmt", ["txt", "npy"])
def test_generate_backward_writes_dO_and_keeps_QKV(tmp_path, fmt):
    plain = generate(tmp_path / "plain", "--format", fmt)
    grad = generate(tmp_path / "grad", "--format", fmt, "--backward")
    assert tomllib.loads((grad / INPUT_MANIFEST).read_text())["backward"] is True
    assert "backward" not in tomllib.loads((plain / INPUT_MANIFEST).read_text())
    assert not list(plain.glob(f"{GRAD_INPUT}_head_*"))
    for i in range(DIMS.total_heads):
        for name in INPUT_NAMES:
            assert (plain / stage_file(name, i, fmt)).read_bytes() == (grad / stage_file(name, i, fmt)).read_bytes()
        do = read_matrix(grad / stage_file(GRAD_INPUT, i, fmt), STAGES[GRAD_INPUT].shape(DIMS))
        assert do.shape == (7, 24)
        q = read_matrix(grad / stage_file("Q", i, fmt))
        assert not np.array_equal(do.ravel()[:q.size], q.ravel()), "dO repeats Q's random stream"
    case = load_input_case(grad)
    assert case.backward and case.inputs[-1] == GRAD_INPUT
    assert not load_input_case(plain).backward


def test_regenerating_without_backward_removes_the_old_dO(tmp_path):
    folder = generate(tmp_path / "c", "--backward")
    generate(folder)
    assert not list(folder.glob(f"{GRAD_INPUT}_head_*"))
    assert not load_input_case(folder).backward


def test_generate_refuses_a_folder_holding_only_someone_elses_dO(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    np.save(folder / stage_file(GRAD_INPUT, 0, "npy"), np.zeros((7, 24), np.float32))
    res = CliRunner().invoke(cli, ["generate", "--out", str(folder), *DIM_ARGS])
    line = _one_line_error(res)
    assert "already holds an input case" in line and stage_file(GRAD_INPUT, 0, "npy") in line


def test_missing_dO_for_one_head_names_the_file(tmp_path):
    folder = generate(tmp_path / "c", "--backward")
    (folder / stage_file(GRAD_INPUT, 2, "txt")).unlink()
    with pytest.raises(CaseError, match=r"dO_head_2\.txt: missing file \(the manifest says backward = true\)"):
        load_input_case(folder)


def test_dO_files_without_the_manifest_flag_need_every_head(tmp_path):
    folder = generate(tmp_path / "c", "--backward")
    text = (folder / INPUT_MANIFEST).read_text()
    (folder / INPUT_MANIFEST).write_text(text.replace("backward = true\n", ""))
    (folder / stage_file(GRAD_INPUT, 3, "txt")).unlink()
    with pytest.raises(CaseError, match=r"dO_head_3\.txt: missing file \(the case has dO files"):
        load_input_case(folder)


def test_manifest_backward_false_with_dO_files_is_an_error(tmp_path):
    folder = generate(tmp_path / "c", "--backward")
    text = (folder / INPUT_MANIFEST).read_text()
    (folder / INPUT_MANIFEST).write_text(text.replace("backward = true", "backward = false"))
    with pytest.raises(CaseError, match=r"dO_head_0\.txt: exists but .* says backward = false"):
        load_input_case(folder)


def test_dO_of_the_wrong_shape_is_refused_when_loaded(tmp_path):
    folder = generate(tmp_path / "c", "--backward", "--format", "npy")
    np.save(folder / stage_file(GRAD_INPUT, 1, "npy"), np.zeros((7, 16), np.float32))
    case = load_input_case(folder)
    with pytest.raises(CaseError, match=r"dO_head_1\.npy"):
        case.load(GRAD_INPUT, 1)


def test_generated_backward_case_runs_every_backward_stage(tmp_path, binary):
    folder = generate(tmp_path / "c", "--backward", "--format", "npy")
    res = CliRunner().invoke(cli, ["run", "--in", str(folder), "--out", str(tmp_path / "out"), "--backend", "cpu",
                                   "--binary", str(binary), "--stages", "dV"])
    assert res.exit_code == 0, res.output
    for i in range(DIMS.total_heads):
        assert np.load(tmp_path / "out" / stage_file("dV", i, "npy")).shape == (13, 24)
