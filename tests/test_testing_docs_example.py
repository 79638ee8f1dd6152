"""The property-test example of docs/testing.md, executed for real (50 examples on 2 ranks).

tests/test_docs.py runs every block of the page once (the World block included); here the
example's own hypothesis test runs its 50 examples on the shared 2-rank world.
"""

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


@settings(max_examples=50, deadline=None)
@given(spec=module_specs(), seed=st.integers(0, 2**16))
def test_docs_property_example(world, spec, seed) -> None:
    assert world(2).run(shard_load_gather, spec, seed) == [True, True]
