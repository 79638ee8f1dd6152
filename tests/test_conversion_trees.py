"""Conversion trees and declared rules (``fsdptk.conversions`` and the engine's node trees), with
no transformers import (these tests run where transformers is not installed):

- property-based: for random expert counts, shapes and boxes, reading a box through the view equals
  the box of the tensor built by plain torch (stack, cat, transpose, chunk), reads only the
  checkpoint tensors the box covers, and the inverse gives back every checkpoint tensor exactly;
- declared rules load a plain model from per-expert files; their errors name the keys and shapes;
- a ``Transform`` whose forward breaks its declared shape or dtype: refused when the rules are
  built (a ``meta`` run of the forward), else on the read of the box that breaks it, on every rank
  at 2 ranks, the model unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from fsdptk import ConversionError, load_safetensors
from fsdptk._engine.layouts import box_shape, extract, full_box
from fsdptk._engine.sources.convert import ConversionProblem, ConvertedSource, Unconverter
from fsdptk.conversions import Chunk, Concat, Conversion, Convert, Rename, Stack, Transform, Transpose


class _Files(dict):
    """A Mapping of tensors that records which keys and boxes were read."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.reads: list[tuple[str, tuple]] = []

    def read(self, key, box=None):
        self.reads.append((key, box))
        t = self[key]
        return t if box is None else extract(t, box)

    def meta(self, key):
        from fsdptk._engine.sources import TensorMeta

        return TensorMeta(tuple(self[key].shape), self[key].dtype)

    def release(self, key):
        pass

    def keys(self):
        return list(super().keys())


def _metas(files):
    return {k: (tuple(v.shape), v.dtype) for k, v in files.items()}


@st.composite
def _boxes(draw, shape):
    box = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        hi = draw(st.integers(lo + 1, n))
        box.append(slice(lo, hi))
    return tuple(box)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), experts=st.integers(1, 6), rows=st.integers(1, 5), cols=st.integers(1, 5),
       transpose=st.booleans())
def test_stack_concat_reads_only_its_box_and_inverts(data, experts, rows, cols, transpose):
    g = torch.Generator().manual_seed(experts * 100 + rows * 10 + cols)
    files = _Files({f"l.experts.{e}.{w}": torch.randn(rows, cols, generator=g)
                    for e in range(experts) for w in ("gate", "up")})
    ops = [Stack(0), Concat(1)] + ([Transpose(1, 2)] if transpose else [])
    conv = Conversion(Convert(["l.experts.#.gate", "l.experts.#.up"], "l.gate_up", ops))
    nodes = conv.nodes(_metas(files))
    want = torch.cat([torch.stack([files[f"l.experts.{e}.gate"] for e in range(experts)]),
                      torch.stack([files[f"l.experts.{e}.up"] for e in range(experts)])], 1)
    if transpose:
        want = want.transpose(1, 2)
    assert nodes["l.gate_up"].shape == tuple(want.shape)
    box = data.draw(_boxes(tuple(want.shape)))
    view = ConvertedSource(files, nodes)
    got = view.read("l.gate_up", box)
    assert torch.equal(got, extract(want, box))
    # only the experts the box covers, and only gate (or up) when the box covers only those rows
    expert_box = box[0]
    row_dim = 2 if transpose else 1
    halves = {"gate" if i < rows else "up" for i in range(box[row_dim].start, box[row_dim].stop)}
    read = {k for k, _ in files.reads}
    assert read == {f"l.experts.{e}.{w}" for e in range(expert_box.start, expert_box.stop) for w in halves}
    assert sum(torch.Size(box_shape(b)).numel() for _, b in files.reads) == torch.Size(box_shape(box)).numel()
    back = dict(Unconverter(nodes).feed("l.gate_up", want))
    assert sorted(back) == sorted(files) and all(torch.equal(back[k], files[k]) for k in files)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), parts=st.integers(1, 4), rows=st.integers(1, 9), cols=st.integers(1, 4))
def test_chunk_reads_each_part_and_reassembles(data, parts, rows, cols):
    files = _Files({"qkv": torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)})
    targets = [f"p{i}" for i in range(parts)]
    conv = Conversion(Convert("qkv", targets, [Chunk(0)]))
    nodes = conv.nodes(_metas(files))
    chunks = torch.chunk(files["qkv"], parts, 0)
    assert sorted(nodes) == sorted(targets[:len(chunks)])  # torch.chunk's count
    view = ConvertedSource(files, nodes)
    for name, want in zip(targets, chunks):
        box = data.draw(_boxes(tuple(want.shape)))
        assert torch.equal(view.read(name, box), extract(want, box))
    un = Unconverter(nodes)
    out = []
    for name, want in zip(targets, chunks):
        out += un.feed(name, want)
    assert [k for k, _ in out] == ["qkv"] and torch.equal(out[0][1], files["qkv"])
    assert un.unfinished() == []


def test_transform_reads_whole_tensor_unless_box_wise():
    files = _Files({"w": torch.arange(12.0).reshape(4, 3)})
    flip = Conversion(Convert("w", "v", [Transform(lambda t: t.flip(0), lambda t: t.flip(0))]))
    view = ConvertedSource(files, flip.nodes(_metas(files)))
    assert torch.equal(view.read("v", (slice(0, 1), slice(0, 3))), files["w"][3:4])
    assert files.reads == [("w", full_box((4, 3)))]
    files.reads.clear()
    neg = Conversion(Convert("w", "v", [Transform(torch.neg, torch.neg, box_wise=True)]))
    view = ConvertedSource(files, neg.nodes(_metas(files)))
    assert torch.equal(view.read("v", (slice(1, 2), slice(0, 3))), -files["w"][1:2])
    assert files.reads == [("w", (slice(1, 2), slice(0, 3)))]


# ---------------------------------------------------------------------------------------------
# declared rules into a plain model
class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.zeros(3, 8, 4))
        self.router = torch.nn.Linear(4, 3, bias=False)


_RULES = Conversion(
    Convert(["e.#.gate", "e.#.up"], "w13", [Stack(0), Concat(1)]),
    Rename("gate.weight", "router.weight"),
)


def _write(d: Path, files: dict) -> Path:
    save_file(files, d / "model.safetensors")
    return d


def test_declared_rules_load_a_plain_model(tmp_path):
    files = {f"e.{i}.{w}": torch.randn(4, 4) for i in range(3) for w in ("gate", "up")}
    files["gate.weight"] = torch.randn(3, 4)
    model = _Experts()
    assert load_safetensors(model, _write(tmp_path, files), conversion=_RULES) == ([], [])
    assert torch.equal(model.w13[1, 4:], files["e.1.up"]) and torch.equal(model.router.weight, files["gate.weight"])


def test_declared_rules_name_a_missing_index_and_shapes_that_do_not_stack(tmp_path):
    files = {f"e.{i}.{w}": torch.randn(4, 4) for i in (0, 2) for w in ("gate", "up")}
    files["gate.weight"] = torch.randn(3, 4)
    with pytest.raises(ConversionError, match=r"lacks \['e\.1\.gate'\]"):
        load_safetensors(_Experts(), _write(tmp_path, files), conversion=_RULES)
    files = {f"e.{i}.{w}": torch.randn(4, 4) for i in range(3) for w in ("gate", "up")}
    files["e.2.up"] = torch.randn(4, 5)
    files["gate.weight"] = torch.randn(3, 4)
    d = tmp_path / "b"
    d.mkdir()
    with pytest.raises(ConversionError, match=r"'e\.2\.up' \(shape \[4, 5\].*'e\.0\.up' \(shape \[4, 4\]"):
        load_safetensors(_Experts(), _write(d, files), conversion=_RULES)


def test_rule_patterns_are_checked():
    with pytest.raises(ValueError, match="same number of '\\*'"):
        Rename("a.*.b", "c")
    with pytest.raises(ValueError, match="targets no '#'"):
        Convert("a.#.w", "b.#", [Stack(0)])
    with pytest.raises(TypeError, match="Rename and Convert"):
        Conversion("a")  # type: ignore[arg-type]
    with pytest.raises(ConversionError, match="both load into 'x'"):
        Conversion(Rename("a", "x"), Rename("b", "x")).nodes({"a": ((1,), None), "b": ((1,), None)})


def test_a_declared_conversion_is_refused_for_a_save(tmp_path):
    from fsdptk import save_safetensors

    with pytest.raises(TypeError, match="declared Conversion applies to loads"):
        save_safetensors(_Experts(), tmp_path, conversion=_RULES)




# ---------------------------------------------------------------------------------------------
# a Transform that breaks what it declares
def test_a_transform_is_run_on_meta_when_built_and_named_with_both_shapes():
    metas = {"w": ((4, 6), torch.float32)}
    cut = Conversion(Convert("w", "layers.0.q", [Transform(lambda t: t[:, :3], lambda t: t)]))
    with pytest.raises(ConversionError) as info:
        cut.nodes(metas)
    message = str(info.value)
    for needle in ("model key 'layers.0.q'", "'w'", "declares shape [4, 6] (torch.float32)",
                   "returned shape [4, 3] (torch.float32)"):
        assert needle in message, (needle, message)
    cast = Conversion(Convert("w", "v", [Transform(lambda t: t.double(), lambda t: t.float())]))
    with pytest.raises(ConversionError, match=r"declares shape \[4, 6\] \(torch.float32\).*returned shape "
                                              r"\[4, 6\] \(torch.float64\)"):
        cast.nodes(metas)
    declared = Conversion(Convert("w", "v", [Transform(lambda t: t.double(), lambda t: t.float(),
                                                       dtype=lambda d: torch.float64)]))
    assert declared.nodes(metas)["v"].dtype == torch.float64  # what it declares, it yields
    not_a_tensor = Conversion(Convert("w", "v", [Transform(lambda t: t.shape, lambda t: t)]))
    with pytest.raises(ConversionError, match="returned a Size, not a tensor"):
        not_a_tensor.nodes(metas)


def test_a_transform_that_needs_values_is_checked_on_every_read():
    files = _Files({"w": torch.arange(24.0).reshape(4, 6) - 12})  # rows 0-1 negative, 2-3 positive
    picky = Transform(lambda t: t if bool((t >= 0).all()) else t[:1], lambda t: t, box_wise=True)
    nodes = Conversion(Convert("w", "v", [picky])).nodes(_metas(files))  # no meta run: needs values
    view = ConvertedSource(files, nodes)
    assert torch.equal(view.read("v", (slice(2, 4), slice(0, 6))), files["w"][2:4])
    with pytest.raises(ConversionProblem) as info:
        view.read("v", (slice(0, 2), slice(0, 6)))
    message = str(info.value)
    for needle in ("model key 'v'", "declares shape [2, 6]", "box [0:2, 0:6]", "returned shape [1, 6]"):
        assert needle in message, (needle, message)
    whole = Transform(lambda t: t if bool((t >= 0).all()) else t[:, :5], lambda t: t)
    view = ConvertedSource(files, Conversion(Convert("w", "v", [whole])).nodes(_metas(files)))
    with pytest.raises(ConversionProblem, match=r"model key 'v'.*returned shape \[4, 5\]"):
        view.read("v", (slice(2, 4), slice(0, 6)))  # the whole tensor is checked, not just the box


def _local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _load_through_a_bad_transform(path: str, case: str, shard_on_read: bool) -> tuple[str, str, list[str]]:
    """A 2-layer model, FSDP-sharded on 2 ranks, loaded through a Transform of '1.weight' that
    breaks its declaration: (error class, message, keys whose local values changed)."""
    from fsdptk import shard_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    shard_model(model, lambda name, module: name == "1", cpu_offload=False)
    before = _local(model)
    if case == "built":  # runs on meta: refused when the rules are built
        op = Transform(lambda t: t[:, :3], lambda t: t)
    elif case == "declared":  # declares a shape the model does not have: refused by the agreement
        op = Transform(lambda t: t[:, :3], lambda t: t, shape=lambda s: (s[0], 3))
    else:  # needs values: only the box of rows 2-3 (rank 1's shard, negative values) breaks it
        op = Transform(lambda t: t if bool((t >= 0).all()) else t[:1], lambda t: t, box_wise=True)
    try:
        load_safetensors(model, path, conversion=Conversion(Convert("1.weight", "1.weight", [op])),
                         shard_on_read=shard_on_read)
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        after = _local(model)
        return type(e).__name__, str(e), [k for k in before if not torch.equal(before[k], after[k])]
    return "no error", "", []


@pytest.mark.parametrize("shard_on_read", [True, False], ids=["shard-on-read", "rank0-read"])
@pytest.mark.parametrize("case, kinds, needles", [
    ("built", {"ConversionError"}, ["model key '1.weight'", "declares shape [4, 6]", "returned shape [4, 3]"]),
    ("declared", {"ValueError"}, ["'1.weight'", "the source has [4, 3], the model has [4, 6]"]),
    ("one box", {"ConversionError"}, ["model key '1.weight'", "returned shape [1, 6]"]),
])
def test_a_transform_that_breaks_its_declaration_is_one_error_and_the_model_unchanged(
        world, tmp_path, shard_on_read, case, kinds, needles):
    w1 = torch.arange(24.0).reshape(4, 6) + 1
    w1[2:] *= -1  # rank 1's rows
    save_file({"0.weight": torch.ones(6, 4), "0.bias": torch.ones(6), "1.weight": w1, "1.bias": torch.ones(4)},
              tmp_path / "model.safetensors")
    results = world(2).run(_load_through_a_bad_transform, str(tmp_path), case, shard_on_read, timeout=60)
    if case == "one box":  # shard-on-read: rank 1 reads its rows and fails; rank 0 reads them all
        needles = needles + (["declares shape [2, 6]", "box [2:4, 0:6]", "(on rank 1)"] if shard_on_read
                             else ["declares shape [4, 6]", "box [0:4, 0:6]"])
    for rank, (kind, message, changed) in enumerate(results):
        assert kind in kinds, (kind, message)
        assert all(n in message for n in needles if n != "(on rank 1)" or rank == 0), (needles, message)
        assert changed == [], changed  # nothing assigned: every parameter as before the call
