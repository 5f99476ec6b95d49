"""The "house" section of docs/design.md: every top-level room of the package (a module or a
package) with the first sentence of its docstring, generated so that it says what the code says.

    python docs/tools/house.py            # rewrites the section
    python docs/tools/house.py --check    # status 1 when it is stale

tests/test_design_house.py holds docs/design.md to it.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "moco_retrieval"
DESIGN = REPO / "docs" / "design.md"
BEGIN, END = "<!-- house: begin (python docs/tools/house.py) -->", "<!-- house: end -->"
ORDER = ["train.py", "evaluate.py", "search.py", "mine.py", "export", "training", "objectives", "model", "data",
         "evaluation", "mining", "command.py", "config.py", "errors.py", "distributed.py", "files.py", "progress.py"]


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    para = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    match = re.match(r"(.+?\.)(\s|$)", para)
    return match.group(1) if match else para


def rooms() -> list[tuple[str, str]]:
    found = {p.name for p in PACKAGE.iterdir() if (p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").exists() and p.name != "__pycache__")}
    missing = found - set(ORDER)
    if missing:  # a new room must take its place in the picture
        raise SystemExit(f"docs/tools/house.py: place {sorted(missing)} in ORDER")
    out = []
    for name in ORDER:
        path = PACKAGE / name
        doc_file = path / "__init__.py" if path.is_dir() else path
        entry = name + ("/" if path.is_dir() else "")
        out.append((entry, first_sentence(doc_file)))
    return out


def section() -> str:
    width = max(len(e) for e, _ in rooms())
    lines = []
    for entry, text in rooms():
        wrapped = textwrap.wrap(text, 100 - width - 4)
        lines.append(f"  {entry:<{width}}  {wrapped[0]}")
        lines += [f"  {'':<{width}}  {more}" for more in wrapped[1:]]
    return f"{BEGIN}\n```\nmoco_retrieval/\n" + "\n".join(lines) + f"\n```\n{END}"


def render(text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DESIGN}: no house section ({BEGIN} ... {END})")
    return pattern.sub(lambda _: section(), text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/tools/house.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="status 1 when docs/design.md's house section is stale")
    args = parser.parse_args(argv)
    text = DESIGN.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DESIGN} is stale: python docs/tools/house.py", file=sys.stderr)
            return 1
        return 0
    DESIGN.write_text(new, encoding="utf-8")
    print(f"wrote {DESIGN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
