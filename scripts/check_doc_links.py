#!/usr/bin/env python3
"""check_doc_links.py [ROOT] — checks that every relative link in README.md, docs/*.md,
examples/README.md and tests/README.md points to an existing file and, with #anchor, to a heading
of that file (the anchors GitHub makes). Links inside code blocks are not links. Exits 1 when one
is broken. tests/test_docs.py runs it."""
from __future__ import annotations

import pathlib
import re
import sys
from typing import Iterable, List

REPO = pathlib.Path(__file__).resolve().parent.parent


def doc_files(root: pathlib.Path) -> List[pathlib.Path]:
    """The documents whose links are checked (those of them that exist)."""
    named = [root / "README.md", root / "examples" / "README.md", root / "tests" / "README.md"]
    return [p for p in named if p.is_file()] + sorted((root / "docs").glob("*.md"))


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchors(path: pathlib.Path) -> set:
    """The heading anchors of a Markdown file: lower case, punctuation dropped, spaces to '-',
    a repeated heading numbered."""
    out, seen = set(), {}
    for line in _without_code_blocks(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def broken_links(files: Iterable[pathlib.Path], root: pathlib.Path) -> tuple[int, List[str]]:
    """(relative links checked, one line per broken one: the file, then what is missing)."""
    bad, count = [], 0
    for f in files:
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(f.read_text())):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            count += 1
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                bad.append(f"{f.relative_to(root)}: missing file {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{f.relative_to(root)}: missing anchor {target}")
    return count, bad


def main(argv: List[str]) -> int:
    root = pathlib.Path(argv[1]) if len(argv) > 1 else REPO
    count, bad = broken_links(doc_files(root), root)
    for line in bad:
        print(line)
    print(f"{count} relative links checked, {len(bad)} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
