"""The property-test example of docs/testing.md, executed for real (50 examples on 2 ranks)."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptk.testing.strategies import module_specs

_DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
_blocks = re.findall(r"```python\n(.*?)```", _DOC.read_text(), flags=re.S)
_ns: dict = {"__name__": "fsdptk_docs_testing_example"}
exec(compile(_blocks[1], str(_DOC), "exec"), _ns)  # defines shard_load_gather and test_round_trip
shard_load_gather = _ns["shard_load_gather"]


def test_docs_world_block_runs() -> None:
    exec(compile(_blocks[0], str(_DOC), "exec"), {"__name__": "fsdptk_docs_world_block"})


@settings(max_examples=50, deadline=None)
@given(spec=module_specs(), seed=st.integers(0, 2**16))
def test_docs_property_example(world, spec, seed) -> None:
    assert world(2).run(shard_load_gather, spec, seed) == [True, True]
