"""verify/report/junit.py write_junit: the JUnit structure CI tools read, and well-formed XML whatever a
message quotes."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from types import SimpleNamespace

from verify.report.junit import write_junit


def _result(stage, head, status, message="", diagnosis=()):
    return SimpleNamespace(stage=stage, head=head, status=status, passed=status == "PASS", main=None,
                           message=message, resolution="exact float32", diagnosis=list(diagnosis), flash_attn=None)


def _suite(tmp_path, results):
    path = tmp_path / "r.xml"
    run = SimpleNamespace(precision="tf32", math="ieee", backend="cpu")
    write_junit(SimpleNamespace(results=results, run=run, program_checks=[]), path)
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    return root.find("testsuite")


def test_junit_structure(tmp_path):
    why = SimpleNamespace(code="scale", message="QK_scaled is QK times 2 <not> the scale & more")
    suite = _suite(tmp_path, [_result("QK", 0, "PASS"),
                              _result("QK_scaled", 1, "FAIL", 'off by "2x"', [why])])
    assert (suite.get("name"), suite.get("tests"), suite.get("failures"), suite.get("errors")) == \
        ("attnstep", "2", "1", "0")
    props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    assert props == {"precision": "tf32", "math": "ieee", "arithmetic": "tf32, attnstep's cpu backend"}
    ok, bad = suite.findall("testcase")
    assert (ok.get("classname"), ok.get("name")) == ("attnstep.QK", "head_0")
    assert ok.find("failure") is None
    assert ok.find("properties/property[@name='resolution']").get("value") == "exact float32"
    assert (bad.get("classname"), bad.get("name")) == ("attnstep.QK_scaled", "head_1")
    failure = bad.find("failure")
    assert failure.get("type") == "FAIL" and failure.get("message") == 'off by "2x"'
    assert failure.text == 'off by "2x"\nscale: QK_scaled is QK times 2 <not> the scale & more'


def test_junit_stays_well_formed_with_control_characters_and_undecodable_names(tmp_path):
    # A file name with an escape byte and one that is not UTF-8 (as os.fsdecode gives it).
    name = "out/QK\x1b[31m_head_0.txt and out/\udcff.txt"
    suite = _suite(tmp_path, [_result("QK", 0, "ERROR", f"{name}: cannot read")])
    failure = suite.find("testcase/failure")
    assert failure.get("message") == "out/QK\\x1b[31m_head_0.txt and out/\\udcff.txt: cannot read"
    assert failure.text.startswith("out/QK\\x1b[31m")
