"""A check's report as JUnit XML (`check --junit`): one testcase per stage and head (per K/V head,
`kv_head_<j>`, for a grouped case's K/V stages), one per program check and one per run-level
check (dropout's keep rate)."""
from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from ..check import flash_attn_criterion
from ..check.results import HeadResult, Report
from ..files.case import atomic_write_bytes
from ..runs import program_checks
from ..text import number as _g
from .text import arithmetic


# Characters XML 1.0 cannot carry, not even as character references (a message may quote a file
# name with control characters or undecodable bytes): written as Python escapes instead.
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode(), text)


def _junit_failure(r: HeadResult) -> ET.Element:
    c = r.main
    msg = r.message or (f"{c.mismatched}/{c.total} elements outside the tolerance; worst "
                        f"got {_g(c.got)} want {_g(c.want)}" if c else r.status)
    failure = ET.Element("failure", type=_xml_text(r.status), message=_xml_text(msg))
    failure.text = _xml_text("\n".join([msg] + [f"{d.code}: {d.message}" for d in r.diagnosis]))
    return failure


def write_junit(report: Report, path: Path) -> None:
    """One testcase per stage and head; a failing one carries its message and diagnosis."""
    root = ET.Element("testsuites")
    # (A report's run-level checks and K/V heads are newer than some of its duck-typed stand-ins.)
    checks, run_checks = report.program_checks, getattr(report, "run_checks", [])
    suite = ET.SubElement(root, "testsuite", name="attnstep",
                          tests=str(len(report.results) + len(checks) + len(run_checks)),
                          failures=str(sum(not r.passed for r in report.results) + sum(not c.passed for c in checks)
                                       + sum(not c.passed for c in run_checks)),
                          errors="0")
    suite_props = ET.SubElement(suite, "properties")  # what the bounds assume: a CI job sees a loosened check
    for name, value in (("precision", report.run.precision), ("math", report.run.math),
                        ("arithmetic", arithmetic(report.run)), *flash_attn_criterion.junit_properties(report)):
        ET.SubElement(suite_props, "property", name=name, value=_xml_text(str(value)))
    for name, failure in program_checks.junit_cases(report.program_checks):
        case = ET.SubElement(suite, "testcase", classname="attnstep.program", name=name)
        if failure:
            ET.SubElement(case, "failure", type=name, message=_xml_text(failure)).text = _xml_text(failure)
    for c in run_checks:  # over the whole run: the stage's, not one head's
        case = ET.SubElement(suite, "testcase", classname=f"attnstep.{c.stage}", name=c.code)
        if not c.passed:
            ET.SubElement(case, "failure", type=c.code, message=_xml_text(c.message)).text = _xml_text(c.message)
    for r in report.results:
        name = f"{'kv_head' if getattr(r, 'kv', False) else 'head'}_{r.head}"  # a grouped case's K/V stages
        if getattr(r, "packed", False):  # a packed case: one per head and sequence
            name += "_padding_rows" if r.sequence is None else f"_seq_{r.sequence}"
        case = ET.SubElement(suite, "testcase", classname=f"attnstep.{r.stage}", name=name)
        props = ET.SubElement(case, "properties")
        ET.SubElement(props, "property", name="resolution", value=_xml_text(r.resolution))
        if not r.passed:
            case.append(_junit_failure(r))
    ET.indent(root)
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="UTF-8", xml_declaration=True)
    atomic_write_bytes(Path(path), buf.getvalue() + b"\n")
