"""Every Python code block in README.md and docs/*.md runs, and the docs site is wired up.

How a page's ```python blocks are run (markers are HTML comments, invisible on the site, on the
line(s) just before the opening fence):

- no marker: the block runs in this (single) process. All unmarked blocks of a page share one
  namespace, in page order, with a temporary directory as the working directory.
- ``<!-- world: N -->``: the block runs on every rank of the persistent N-process gloo world
  (``fsdptk.testing``), as it would under ``torchrun --nproc_per_node=N``. All world blocks of a page
  with the same N share one namespace per rank, in page order. The process group is already
  initialised there, so a script's own ``dist.init_process_group(...)`` and
  ``dist.destroy_process_group()`` are skipped while the block runs; ``__name__`` is
  ``"__main__"``.
- ``<!-- no-run: REASON -->``: not run. Only for blocks that need something a test cannot give
  (a GPU, files a long job writes) and whose behaviour another test covers; REASON says which.

Blocks in other languages (bash, text, yaml) are not run.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", *DOCS.glob("*.md")], key=lambda p: str(p))
_FENCE = re.compile(r"^(\s*)```+\s*([\w+-]*)")
_MARK = re.compile(r"<!--\s*(no-run|world)\s*:?\s*(.*?)\s*-->")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    mode: str  # "local", "world", "skip"
    ranks: int = 1
    reason: str = ""


def parse_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown file with their run markers."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        mode, ranks, reason = "local", 1, ""
        j = start - 1
        while j >= 0 and (not lines[j].strip() or _MARK.search(lines[j])):
            mk = _MARK.search(lines[j])
            if mk:
                if mk.group(1) == "no-run":
                    mode, reason = "skip", mk.group(2)
                else:
                    mode, ranks = "world", int(mk.group(2))
                break
            j -= 1
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", mode, ranks, reason))
    return blocks


def _python_blocks(path: Path) -> list[Block]:
    return [b for b in parse_blocks(path) if b.lang in ("python", "py", "python3")]


def _exec(blocks: list[tuple[str, str]], cwd: str) -> int:
    """Run ``(label, source)`` blocks in order in one namespace; returns how many ran.

    In a world worker the process group exists already: a script's init/destroy calls are skipped.
    """
    import torch.distributed as dist

    saved = dist.init_process_group, dist.destroy_process_group
    in_world = dist.is_initialized()
    if in_world:
        dist.init_process_group = lambda *a, **k: None  # type: ignore[assignment]
        dist.destroy_process_group = lambda *a, **k: None  # type: ignore[assignment]
    old_cwd = os.getcwd()
    os.chdir(cwd)
    added = str(REPO) not in sys.path
    if added:  # `import examples.llama` works as from the repository root
        sys.path.insert(0, str(REPO))
    ns: dict = {"__name__": "__main__"}
    try:
        for label, source in blocks:
            try:
                exec(compile(source, label, "exec"), ns)  # noqa: S102 - running the docs is the test
            except BaseException as e:
                raise AssertionError(f"code block {label} failed: {type(e).__name__}: {e}") from e
    finally:
        os.chdir(old_cwd)
        if added:
            sys.path.remove(str(REPO))
        dist.init_process_group, dist.destroy_process_group = saved
    return len(blocks)


def _label(b: Block) -> str:
    return f"{b.path.relative_to(REPO)}:{b.line}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run(page: Path, world, tmp_path):
    blocks = _python_blocks(page)
    for b in blocks:
        if b.mode == "skip":
            assert b.reason, f"{_label(b)}: a no-run marker must say why (<!-- no-run: REASON -->)"
    local = [(_label(b), b.source) for b in blocks if b.mode == "local"]
    if local:
        _exec(local, str(tmp_path))
    for n in sorted({b.ranks for b in blocks if b.mode == "world"}):
        mine = [(_label(b), b.source) for b in blocks if b.mode == "world" and b.ranks == n]
        rank_dir = tmp_path / f"world{n}"
        rank_dir.mkdir()
        assert world(n).run(_exec, mine, str(rank_dir), timeout=300) == [len(mine)] * n


def test_marker_parser_understands_every_form(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "```python\na = 1\n```\n\n<!-- world: 2 -->\n```python\nb = 2\n```\n"
        "<!-- no-run: needs a GPU; tests/test_x.py covers it -->\n\n```py\nc = 3\n```\n"
        "```bash\necho hi\n```\n   ```python\n   d = 4\n   ```\n"
    )
    got = [(b.lang, b.mode, b.ranks, b.reason, b.source) for b in parse_blocks(page)]
    assert got == [
        ("python", "local", 1, "", "a = 1\n"),
        ("python", "world", 2, "", "b = 2\n"),
        ("py", "skip", 1, "needs a GPU; tests/test_x.py covers it", "c = 3\n"),
        ("bash", "local", 1, "", "echo hi\n"),
        ("python", "local", 1, "", "d = 4\n"),
    ]


def test_no_run_exceptions_stay_few():
    skipped = [_label(b) for p in PAGES for b in _python_blocks(p) if b.mode == "skip"]
    assert len(skipped) <= 6, f"too many <!-- no-run --> blocks: {skipped}"


# -- the site ----------------------------------------------------------------------------------
def _nav_pages() -> list[str]:
    text = (REPO / "mkdocs.yml").read_text()
    start = text.index("\nnav:")
    return re.findall(r":\s*([\w/.-]+\.md)\s*$", text[start:], flags=re.M)


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages()
    assert len(nav) == len(set(nav)), f"duplicate nav entries: {nav}"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml nav names pages that do not exist: {missing}"
    orphans = sorted(p.name for p in DOCS.glob("*.md") if p.name not in nav)
    assert not orphans, f"docs pages missing from the mkdocs.yml nav: {orphans}"


def test_api_reference_names_importable_modules():
    import importlib

    targets = re.findall(r"^:::\s*([\w.]+)", (DOCS / "api.md").read_text(), flags=re.M)
    assert "fsdptk.sharding" in targets and "fsdptk.cli" in targets
    for t in targets:
        importlib.import_module(t)


def test_api_reference_lists_every_top_level_name():
    """Each name of ``fsdptk.__all__`` is in the ``__all__`` of a module api.md renders (the
    reference shows a module's ``__all__``), so no public name is missing from the site."""
    import importlib

    import fsdptk

    targets = re.findall(r"^:::\s*([\w.]+)", (DOCS / "api.md").read_text(), flags=re.M)
    shown = {n for t in targets for n in getattr(importlib.import_module(t), "__all__", ())}
    assert sorted(set(fsdptk.__all__) - shown) == []
    assert {"fsdptk.buffers", "fsdptk.hf"} <= set(targets)


def test_relative_links_between_pages_resolve():
    bad = []
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).is_file():
                bad.append(f"{page.relative_to(REPO)} -> {target}")
    assert not bad, f"broken links: {bad}"
