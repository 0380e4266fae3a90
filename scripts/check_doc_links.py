#!/usr/bin/env python3
"""check_doc_links.py [ROOT] — checks that every relative link in README.md, docs/*.md and
examples/README.md points to an existing file and, with #anchor, to a heading of that file (the
anchors GitHub makes). Links inside code blocks are not links. Exits 1 when one is broken."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
files = [root / "README.md", root / "examples" / "README.md", *sorted((root / "docs").glob("*.md"))]

def anchors(path):
    """The heading anchors of a Markdown file: lower case, punctuation dropped, spaces to '-',
    a repeated heading numbered."""
    out = set()
    seen = {}
    text = path.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m: continue
        a = m.group(1).strip().lower()
        a = re.sub(r"[^\w\- ]", "", a).replace(" ", "-")
        n = seen.get(a, 0); seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out

bad = 0; count = 0
for f in files:
    text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target): continue
        count += 1
        path, _, anchor = target.partition("#")
        dest = (f.parent / path).resolve() if path else f
        if not dest.exists():
            print(f"{f.relative_to(root)}: missing file {target}"); bad += 1; continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            print(f"{f.relative_to(root)}: missing anchor {target}"); bad += 1
print(f"{count} relative links checked, {bad} broken")
sys.exit(1 if bad else 0)
