"""The documents' links: every relative link and #anchor in README.md, docs/*.md,
examples/README.md and tests/README.md leads somewhere (scripts/check_doc_links.py), and a broken
one is caught."""
from __future__ import annotations

import importlib.util

from helpers.environment import REPO


def _link_checker():
    spec = importlib.util.spec_from_file_location("check_doc_links", REPO / "scripts" / "check_doc_links.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_relative_link_of_the_documents_leads_somewhere():
    links = _link_checker()
    files = links.doc_files(REPO)
    assert {REPO / "README.md", REPO / "examples" / "README.md", REPO / "tests" / "README.md"} <= set(files)
    count, bad = links.broken_links(files, REPO)
    assert bad == [] and count > 0


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    links = _link_checker()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# The guide\n\n## Running it\n")
    readme = tmp_path / "README.md"
    readme.write_text("[ok](docs/guide.md#running-it) [gone](docs/gone.md) [no heading](docs/guide.md#building)\n"
                      "[web](https://example.com/x)\n```\n[in code](nowhere.md)\n```\n")
    count, bad = links.broken_links([readme], tmp_path)
    assert count == 3
    assert bad == ["README.md: missing file docs/gone.md", "README.md: missing anchor docs/guide.md#building"]
    assert links.main(["check_doc_links.py", str(tmp_path)]) == 1
