"""Signature parity with torchtune 0.6.1 for every name fsdptk shares with ``torchtune.training``.

A call written for torchtune must bind the same way to fsdptk: positional parameters with the same
names, order and defaults, torchtune's keyword-only parameters present with the same defaults, and
anything fsdptk adds keyword-only (and listed on docs/migration.md).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torchtune.training as tt
import torchtune.training._distributed as ttd

import fsdptk

from ttparity import SHARED

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
MIGRATION = Path(__file__).resolve().parents[1] / "docs" / "migration.md"


def _render(sig: inspect.Signature) -> str:
    """``(a, b=1, *args, c, **kw)``: names and defaults only, as docs/migration.md writes them."""
    out, star = [], False
    for p in sig.parameters.values():
        if p.kind is _P.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
            continue
        if p.kind is _P.VAR_KEYWORD:
            out.append(f"**{p.name}")
            continue
        if p.kind is _P.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is _P.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(out) + ")"


def _row(name: str) -> str:
    rows = [ln for ln in MIGRATION.read_text().splitlines() if ln.startswith(f"| `{name}(")]
    assert len(rows) == 1, f"docs/migration.md needs exactly one table row for {name}, got {rows}"
    return rows[0]


def test_shared_names_are_exactly_the_tested_ones() -> None:
    public_tt = {n for n in dir(tt) if not n.startswith("_")}
    assert set(fsdptk.__all__) & public_tt == set(SHARED)
    # the swap in ttparity patches both places torchtune's own code looks the names up
    for name in SHARED:
        assert getattr(tt, name) is getattr(ttd, name), name


@pytest.mark.parametrize("name", SHARED)
def test_positional_signature_matches_torchtune(name: str) -> None:
    theirs = inspect.signature(getattr(tt, name))
    ours = inspect.signature(getattr(fsdptk, name))
    pos = lambda sig: [(p.name, p.kind, p.default)  # noqa: E731
                       for p in sig.parameters.values() if p.kind in _POSITIONAL]
    assert pos(ours) == pos(theirs)
    for kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
        assert ([p.name for p in ours.parameters.values() if p.kind is kind]
                == [p.name for p in theirs.parameters.values() if p.kind is kind]), kind
    # torchtune's keyword-only parameters exist in fsdptk, keyword-only, with the same defaults
    kw = lambda sig: {p.name: p.default for p in sig.parameters.values()  # noqa: E731
                      if p.kind is _P.KEYWORD_ONLY}
    assert kw(theirs).items() <= kw(ours).items()


@pytest.mark.parametrize("name", SHARED)
def test_migration_page_states_signature_and_extras(name: str) -> None:
    """The migration table quotes torchtune's real signature and names every keyword-only
    parameter fsdptk adds."""
    row = _row(name)
    theirs = inspect.signature(getattr(tt, name))
    ours = inspect.signature(getattr(fsdptk, name))
    assert f"`{name}{_render(theirs)}`" in row, (name, _render(theirs))
    extras = [p for n, p in ours.parameters.items() if n not in theirs.parameters]
    assert all(p.kind is _P.KEYWORD_ONLY for p in extras), extras
    for p in extras:
        shown = f"`{p.name}`" if p.default is _P.empty else f"`{p.name}={p.default!r}`"
        assert shown in row, f"docs/migration.md row for {name} must list {shown}"
