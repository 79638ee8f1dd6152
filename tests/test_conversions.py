"""Conversion views (``fsdptk.conversions`` and the engine's node trees) in one process:

- property-based: for random expert counts, shapes and boxes, reading a box through the view equals
  the box of the tensor built by plain torch (stack, cat, transpose, chunk), reads only the
  checkpoint tensors the box covers, and the inverse gives back every checkpoint tensor exactly;
- declared rules load a plain model from per-expert files; their errors name the keys and shapes;
- the offline converters and the CLI speak the Hub layout of a transformers MoE model.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fsdptk import ConversionError, load_safetensors
from fsdptk._engine.layouts import box_shape, extract, full_box
from fsdptk._engine.sources.convert import ConvertedSource, Unconverter
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
# the offline converters and the CLI on a transformers MoE model
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_dir():
    d = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, vocab_size=64, num_experts=4, num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def test_offline_converters_keep_the_hub_layout(moe_dir, tmp_path):
    from fsdptk import dcp_to_safetensors, load_dcp, safetensors_to_dcp
    from fsdptk.hf import hf_meta_model

    meta = hf_meta_model(moe_dir)
    safetensors_to_dcp(moe_dir, tmp_path / "dcp", model=meta)
    plain = transformers.AutoModelForCausalLM.from_pretrained(moe_dir)
    fresh = transformers.AutoModelForCausalLM.from_config(plain.config)
    load_dcp(fresh, tmp_path / "dcp")  # the model's own (fused) keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), plain.state_dict().values()))
    dcp_to_safetensors(tmp_path / "dcp", tmp_path / "hub", model=meta)
    hub, back = load_file(moe_dir / "model.safetensors"), load_file(tmp_path / "hub" / "model.safetensors")
    assert sorted(hub) == sorted(back) and all(torch.equal(hub[k], back[k]) for k in hub)
    dcp_to_safetensors(tmp_path / "dcp", tmp_path / "fused")  # no model: DCP's keys
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "fused" / "model.safetensors")


def test_cli_speaks_the_hub_layout(moe_dir, tmp_path, capsys):
    from fsdptk.cli import main

    assert main(["inspect", str(moe_dir), "--as-model", "--json"]) == 0
    listed = {t["key"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert listed["model.layers.1.mlp.experts.gate_up_proj"]["shape"] == [4, 32, 32]
    assert listed["model.layers.1.mlp.experts.gate_up_proj"]["sources"] == 8
    assert main(["plan", str(moe_dir), "--world-size", "2"]) == 0
    assert "4 model tensors are read from 24 checkpoint tensors" in capsys.readouterr().out
    assert main(["convert", str(moe_dir), str(tmp_path / "dcp")]) == 0  # config.json: model keys
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "hub"), "--config", str(moe_dir)]) == 0
    hub, back = load_file(moe_dir / "model.safetensors"), load_file(tmp_path / "hub" / "model.safetensors")
    assert sorted(hub) == sorted(back) and all(torch.equal(hub[k], back[k]) for k in hub)
    assert main(["convert", str(moe_dir), str(tmp_path / "raw"), "--keep-keys"]) == 0
    assert main(["inspect", str(tmp_path / "raw"), "--json"]) == 0
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in capsys.readouterr().out
