"""Which writer writes which file of a save with several writers (``fsdptk._files.writers``), as
properties that need no transformers:

- hypothesis: every file has exactly one writer, the files of one model tensor share it, no writer
  ends above the stated bound, and the same inputs give the same assignment;
- across processes: every rank of a 4-rank world computes the assignment from the same holdings in
  a process of its own hash seed (``PYTHONHASHSEED`` 1 to 4, set explicitly: the world's own
  processes inherit whatever the parent's environment fixes), and all results are equal. The
  inputs are built so that set or dict iteration order could steer it: several hosts named by
  strings, files and groups of equal size, the same box held on several hosts. A control computed
  in the same processes (the iteration order of a set of the host names) differs between them,
  so an assignment that followed such an order would fail the comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptk._engine.gather import Holdings
from fsdptk._files.writers import SHARE_SLACK, WriterAssignment, assign_files, file_groups


@st.composite
def _layouts(draw):
    n = draw(st.integers(1, 40))
    sizes = draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    items = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True), max_size=60))
    writers = draw(st.integers(1, 9))
    locality = draw(st.lists(st.integers(0, 10**6), min_size=n * writers, max_size=n * writers))
    return sizes, items, writers, locality


@settings(max_examples=200)
@given(_layouts(), st.booleans())
def test_assignment_is_whole_balanced_and_deterministic(layout, use_locality) -> None:
    sizes, items, writers, locality = layout
    groups = file_groups(items, len(sizes))
    assert sorted(f for g in groups for f in g) == list(range(len(sizes)))  # a partition of the files
    for files in items:  # the files of one model tensor share a group
        assert len({next(i for i, g in enumerate(groups) if f in g) for f in files}) == 1

    def local(g: int, w: int) -> int:
        return locality[groups[g][0] * writers + w]

    out = assign_files(sizes, groups, writers, local if use_locality else None)
    assert len(out) == len(sizes) and all(0 <= w < writers for w in out)  # each file exactly one writer
    for g in groups:
        assert len({out[f] for f in g}) == 1
    load = [sum(s for s, w in zip(sizes, out) if w == k) for k in range(writers)]
    share, largest = sum(sizes) / writers, max(sum(sizes[f] for f in g) for g in groups)
    assert max(load) <= max(SHARE_SLACK * share, share + largest) + 1e-6
    assert out == assign_files(list(sizes), [list(g) for g in groups], writers,
                               local if use_locality else None)


# ----------------------------------------------------------------------------------------------
# the same assignment in processes of different hash seeds
HOSTS = [f"node-{c}" for c in "qwertyuiop"]  # 10 hosts, 2 simulated ranks each


def _inputs() -> dict:
    """JSON-able inputs: 20 simulated ranks on 10 hosts, 4 writers, 12 items over 14 files of equal
    sizes (ties everywhere), every held box held on ranks of two or three hosts."""
    ranks = 2 * len(HOSTS)
    item_files = [[0], [1, 2], [3], [4], [5, 6], [7], [8], [9], [10, 11], [12], [13], [2, 3]]
    boxes = [[[[0, 4]] if (i * 7 + r) % 5 in (0, 3) else None for i in range(len(item_files))]
             for r in range(ranks)]
    return {"ranks": [0, 5, 10, 15], "item_files": item_files, "sizes": [100] * 14, "boxes": boxes,
            "hosts": [HOSTS[r // 2] for r in range(ranks)]}


def _assign(inputs: dict) -> list[int]:
    """Each item's writer and each file's writer, from :func:`_inputs`'s data."""
    items = [(f"t{i}", torch.empty(0, dtype=torch.float32)) for i in range(len(inputs["item_files"]))]
    assignment = WriterAssignment(inputs["ranks"], inputs["item_files"], inputs["sizes"], items)
    boxes = [[None if b is None else tuple(slice(*d) for d in b) for b in per_rank] for per_rank in inputs["boxes"]]
    dests = assignment(Holdings(boxes=boxes, hosts=inputs["hosts"]))
    return list(dests) + list(assignment.files or [])


def _in_a_process(inputs: dict) -> dict:
    """The assignment and the control, computed in this process."""
    return {"assignment": _assign(inputs), "set_order": list(set(inputs["hosts"])),
            "hash_seed": os.environ.get("PYTHONHASHSEED")}


_CHILD = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
          "from test_writer_assignment import _in_a_process; "
          "print(json.dumps(_in_a_process(json.load(sys.stdin))))")


def _on_this_rank(inputs: dict) -> dict:
    """In this world process, and in a child process with ``PYTHONHASHSEED`` = rank + 1."""
    import torch.distributed as dist

    env = {**os.environ, "PYTHONHASHSEED": str(dist.get_rank() + 1)}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(Path(__file__).parent)], input=json.dumps(inputs),
                           env=env, capture_output=True, text=True, timeout=100, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    return {"world": _in_a_process(inputs), "child": json.loads(child.stdout.splitlines()[-1])}


def test_assignment_is_the_same_on_every_rank(world) -> None:
    inputs = _inputs()
    results = world(4).run(_on_this_rank, inputs, timeout=120)
    children = [r["child"] for r in results]
    assert [c["hash_seed"] for c in children] == ["1", "2", "3", "4"]
    assert len({tuple(c["set_order"]) for c in children}) > 1  # the control: set order differs here
    expected = _assign(inputs)
    for rank, r in enumerate(results):
        assert r["child"]["assignment"] == expected, (rank, r["child"]["assignment"], expected)
        assert r["world"]["assignment"] == expected, (rank, r["world"]["assignment"], expected)
    writers = set(expected)
    assert writers == set(inputs["ranks"]), writers  # every writer gets work: the ties were real
