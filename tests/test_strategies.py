"""fsdptk.testing.strategies: specs build deterministically and state dicts match them."""

from __future__ import annotations

import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptk.testing.strategies import TestBlock, build_module, module_names, module_specs, random_state_dict


@settings(max_examples=60)
@given(spec=module_specs(), seed=st.integers(0, 2**16))
def test_state_dict_matches_module(spec, seed: int) -> None:
    spec = pickle.loads(pickle.dumps(spec))  # specs travel to worker processes
    model = build_module(spec)
    sd = random_state_dict(spec, seed)
    assert set(sd) == set(model.state_dict())
    model.load_state_dict(sd, strict=True)
    for key, value in model.state_dict().items():
        assert value.dtype == sd[key].dtype and value.equal(sd[key]), key
    again = random_state_dict(spec, seed)
    assert all(again[k].equal(sd[k]) for k in sd)
    meta = build_module(spec, "meta")
    assert all(p.is_meta for p in meta.parameters())
    assert module_names(spec) == [n for n, _ in model.named_modules()]
    if spec["tied"]:
        assert model.head.weight is model.embed.weight
        assert sd["head.weight"] is sd["embed.weight"]


def test_strategies_cover_the_hard_cases() -> None:
    found = {"tied": False, "nonpersistent": False, "int_buffer": False, "bf16": False, "odd": False}
    @settings(max_examples=300, database=None)
    @given(module_specs())
    def scan(spec) -> None:
        model = build_module(spec, "meta")
        found["tied"] |= bool(spec["tied"])
        persistent = set(model.state_dict())
        for name, buf in model.named_buffers():
            found["nonpersistent"] |= name not in persistent
            found["int_buffer"] |= not buf.dtype.is_floating_point
        for p in model.parameters():
            found["bf16"] |= p.dtype == torch.bfloat16
            found["odd"] |= p.shape[0] % 2 == 1 and p.shape[0] < 4
    scan()
    assert all(found.values()), found


def test_reset_buffers_recomputes_nonpersistent() -> None:
    block = TestBlock({}, [("buf_a", (3,), "float32", False), ("buf_b", (2,), "int64", True)], device="meta")
    block.to_empty(device="cpu")
    block.reset_buffers()
    assert block.buf_a.tolist() == [0.0, 1.0, 2.0]
    assert "buf_a" not in block.state_dict() and "buf_b" in block.state_dict()
