"""Every ``>>>`` example in the package runs (single process; examples that need a process group
or a GPU carry ``# doctest: +SKIP`` with the reason and the test that covers them)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import fsdptk

# importing fsdptk.__main__ runs the CLI; its code is cli.main, whose examples run below
_MODULES = ["fsdptk"] + sorted(m.name for m in pkgutil.walk_packages(fsdptk.__path__, "fsdptk.")
                               if not m.name.endswith(".__main__"))


def test_every_module_is_walked() -> None:
    for name in ("fsdptk.errors", "fsdptk._engine.scatter", "fsdptk._files.lock", "fsdptk.testing.world"):
        assert name in _MODULES


# modules whose examples are their documentation: at least this many must run
_MIN_EXAMPLES = {"fsdptk.buffers": 15, "fsdptk.checkpoint": 5, "fsdptk.dcp": 10, "fsdptk._files.safetensors_io": 3,
                 "fsdptk._files.lock": 3, "fsdptk.errors": 3, "fsdptk.state_dict": 5, "fsdptk.optim": 10}


@pytest.mark.parametrize("name", _MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
    assert result.attempted >= _MIN_EXAMPLES.get(name, 0), (name, result)


def test_skipped_examples_say_why() -> None:
    """A ``+SKIP`` example names its reason on the same line (and is the exception, not the rule)."""
    finder = doctest.DocTestFinder()
    ran = skipped = 0
    for name in _MODULES:
        for test in finder.find(importlib.import_module(name)):
            for ex in test.examples:
                if ex.options.get(doctest.SKIP):
                    skipped += 1
                    first = ex.source.splitlines()[0]
                    assert ("tests/" in ex.source and "# doctest: +SKIP" in first) or \
                        "tests/" in first, f"{test.name}: +SKIP without a reason: {first!r}"
                else:
                    ran += 1
    assert ran > 250 and skipped < ran // 10, (ran, skipped)
