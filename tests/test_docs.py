"""The docs stay true to the tree: every Python module under services/,
libs/ and ferry/ has its line in docs/structures.md, and design citations
name the repository's own design (docs/design.md) and a section it has."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
STRUCTURES = ROOT / "docs" / "structures.md"
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("services", "libs", "ferry")
# Where citations may be written (docs/results holds measurements, not citations).
CITING = ("services", "libs", "ferry", "protos", "tests", "docs", "deploy", "scripts", "README.md", "Makefile")
TEXT_SUFFIXES = {".py", ".pyi", ".proto", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ""}
# Built by parts so that this file does not cite the old document itself.
OLD_CITATION = re.compile("DESIGN" + r"\s*§")
CITATION = re.compile(r"docs/design\.md`?\s*§\s*(\d+(?:\.\d+)?)")


def _tracked(paths: tuple[str, ...]) -> list[pathlib.Path]:
    """Files git tracks under ``paths``; every file there without git (a tarball)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        files = [ROOT / line for line in out.splitlines() if line]
        if files:
            return [f for f in files if f.is_file()]
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for p in paths:
        top = ROOT / p
        found += [top] if top.is_file() else [f for f in top.rglob("*") if f.is_file()
                                              and "__pycache__" not in f.parts]
    return found


def modules() -> list[str]:
    """Python modules a newcomer may open: not generated code, not __init__.py."""
    out = []
    for f in _tracked(PACKAGES):
        rel = f.relative_to(ROOT).as_posix()
        if rel.endswith(".py") and not rel.startswith("libs/pb/") and f.name != "__init__.py":
            out.append(rel)
    return sorted(out)


def mentioned(doc: str) -> set[str]:
    """The module paths docs/structures.md names. A ``## `` heading starts
    with its folder (``## services/instance``, ``## ferry — ...``); a bullet
    names files relative to it, or to the folder its first name gives when
    that name ends with ``/`` (``- `engine/core/` — `block_pool.py` ...``);
    lines that follow a bullet belong to it. A full path counts anywhere."""
    names: set[str] = set()
    root = ""
    folder = ""
    for line in doc.splitlines():
        if line.startswith("## "):
            root = line[3:].split()[0].rstrip("/")
            folder = ""
            continue
        ticks = re.findall(r"`([^`\s]+)`", line)
        if line.startswith("- "):
            folder = ticks[0].rstrip("/") if ticks and ticks[0].endswith("/") else ""
        for t in ticks:
            if not t.endswith(".py"):
                continue
            names.add(t)
            if root:
                names.add(f"{root}/{t}")
                if folder:
                    names.add(f"{root}/{folder}/{t}")
    return names


def design_sections() -> set[str]:
    """``## 5. Scheduling`` gives "5", ``### 6.4 Abort paths`` gives "6.4"."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", DESIGN.read_text(), flags=re.M))


def _texts():
    for f in _tracked(CITING):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("docs/results/") or f.suffix not in TEXT_SUFFIXES or f.stat().st_size > 2_000_000:
            continue
        try:
            yield rel, f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def test_every_module_has_its_line_in_structures_md():
    names = mentioned(STRUCTURES.read_text())
    missing = [m for m in modules() if m not in names]
    assert not missing, "modules missing from docs/structures.md: " + ", ".join(missing)


def test_the_rule_sees_modules_by_section_folder_and_full_path():
    doc = ("## services/instance\n- `engine/core/` — `block_pool.py` (pool),\n  `scheduler.py` (batching)\n"
           "- `streams.py` — streams.\n## ferry — the command line\n- `bench/isa.py` — caps; see "
           "`libs/common/load.py`\n")
    names = mentioned(doc)
    for m in ("services/instance/engine/core/block_pool.py", "services/instance/engine/core/scheduler.py",
              "services/instance/streams.py", "ferry/bench/isa.py", "libs/common/load.py"):
        assert m in names, m
    assert "services/instance/scheduler.py" in names  # harmless: no such module
    assert "ferry/streams.py" not in names


def test_nothing_cites_a_design_outside_the_repository():
    old = [rel for rel, text in _texts() if OLD_CITATION.search(text)]
    assert not old, "cite docs/design.md §N instead of the outside DESIGN" + " §N in: " + ", ".join(old)


def test_every_design_citation_names_a_section_that_exists():
    sections = design_sections()
    assert {str(n) for n in range(1, 10)} <= sections, sorted(sections)
    bad = [f"{rel}: §{n}" for rel, text in _texts() for n in CITATION.findall(text) if n not in sections]
    assert not bad, "docs/design.md has no such section: " + ", ".join(bad)
