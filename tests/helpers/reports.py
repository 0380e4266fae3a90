"""Two JSON reports of `check` compared: the same verdicts, the same fraction of each bound used, and
where both name the same worst element, the same bound at it (to `rtol`); and `check`'s exit status
with its last verdict line."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from verify.cli.group import cli


def check_verdict(in_dir, out_dir, *args):
    """`check --quiet` on a folder: its exit status and its last PASS/FAIL line (else its output)."""
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--quiet", *map(str, args)],
                           catch_exceptions=False)
    verdicts = [line for line in r.output.splitlines() if line.startswith(("PASS", "FAIL"))]
    return r.exit_code, verdicts[-1] if verdicts else r.output


def assert_same_report(a: dict, b: dict, rtol: float, diagnoses: bool = True) -> None:
    """The fraction of each bound used agrees to 1e-6 (the error is a difference that a gradient
    summed in another order changes in its last bits); the bound at the same worst element to rtol;
    with `diagnoses`, each comparison's diagnosis too."""
    assert a["passed"] == b["passed"] and a["first_failing_stage"] == b["first_failing_stage"]
    assert len(a["results"]) == len(b["results"])
    for x, y in zip(a["results"], b["results"]):
        assert (x["stage"], x["head"], x["status"]) == (y["stage"], y["head"], y["status"])
        for side in ("chained", "isolated"):
            p, q = x[side], y[side]
            assert p["passed"] == q["passed"] and p["tol_used"] == pytest.approx(q["tol_used"], rel=1e-6)
            if diagnoses:
                assert p.get("diagnosis") == q.get("diagnosis"), (x["stage"], side)
            if (p["worst"]["row"], p["worst"]["col"]) == (q["worst"]["row"], q["worst"]["col"]):
                assert p["worst"]["allowed"] == pytest.approx(q["worst"]["allowed"], rel=rtol), (x["stage"], side)
