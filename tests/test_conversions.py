"""Conversions of transformers models (the engine's trees over transformers' own mappings):

- the offline converters and the CLI speak the Hub layout of a transformers MoE model;
- a transformers operation with no per-shard plan is refused up front, for loads and saves, naming
  the operation and the keys (every rank, the model and the directory unchanged);
- ``Transpose(check_dims=True)`` (Qwen3-VL-MoE) is planned per shard from the shapes.

The transformers-free tests of the trees and of declared rules are in test_conversion_trees.py.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------
# the offline converters and the CLI on a transformers MoE model
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


# ---------------------------------------------------------------------------------------------
# transformers operations: refused up front without a per-shard plan; Transpose(check_dims) planned
class InterleavedLlamaConfig(transformers.LlamaConfig):
    """A Llama whose checkpoints keep gate and up interleaved in one tensor (as transformers'
    inkling mappings declare it: ``Interleave`` then ``Chunk``), registered below by model type
    (a class name would not survive ``fully_shard``, which renames the root's class)."""

    model_type = "fsdptk_test_interleaved"


class TransposedLlamaConfig(transformers.LlamaConfig):
    """A Llama whose down projections may be stored transposed (``Transpose(check_dims=True)``, as
    transformers' Qwen3-VL-MoE mapping declares its experts)."""

    model_type = "fsdptk_test_transposed"


class ValuesLlamaConfig(transformers.LlamaConfig):
    """A Llama whose (registered) conversion needs the tensors' values: not even its save layout
    can be planned from the shapes."""

    model_type = "fsdptk_test_values"


def _register() -> None:
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Chunk, ConversionOps, Interleave, Transpose, WeightConverter

    class NeedsValues(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            tensor = next(iter(input_dict.values()))
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            tensor.sum().item()  # a value: no meta kernel can give it
            return {target_patterns[0]: tensor}

        @property
        def reverse_op(self):
            return NeedsValues()

    register_checkpoint_conversion_mapping(ValuesLlamaConfig.model_type, [WeightConverter(
        "mlp.down.weight", "mlp.down_proj.weight", [NeedsValues()])], overwrite=True)

    register_checkpoint_conversion_mapping(InterleavedLlamaConfig.model_type, [WeightConverter(
        "mlp.gate_up.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Interleave(dim=0), Chunk(dim=0)])],
        overwrite=True)
    register_checkpoint_conversion_mapping(TransposedLlamaConfig.model_type, [WeightConverter(
        "mlp.down_proj.weight", "mlp.down_proj.weight", [Transpose(0, 1, check_dims=True)])], overwrite=True)


_LLAMA = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)


def _sharded(config_cls: type):
    from fsdptk import shard_model
    from fsdptk.predicates import no_split_modules

    _register()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_cls(**_LLAMA))
    shard_model(model, no_split_modules(model), cpu_offload=False)
    return model


def _local(model) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _refused(path: str, action: str) -> tuple[str, str, list[str]]:
    from fsdptk import load_safetensors, save_safetensors

    model = _sharded(ValuesLlamaConfig if action == "save, values needed" else InterleavedLlamaConfig)
    before = _local(model)
    kind, message = "no error", ""
    try:
        if action == "load":
            load_safetensors(model, path)
        else:
            save_safetensors(model, path)
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        kind, message = type(e).__name__, str(e)
    after = _local(model)
    return kind, message, [k for k in before if not torch.equal(before[k], after[k])]


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("action", ["load", "save", "save, values needed"])
def test_an_op_without_a_per_shard_plan_is_refused_up_front(world, tmp_path, action):
    """transformers' ``Interleave`` has no per-box plan in fsdptk: a load of a checkpoint that
    needs it and a save into its layout are refused on every rank from the metadata, naming the
    operation and the keys; so is a save whose layout needs the values to be planned. The model
    keeps its values and the directory is as it was."""
    torch.manual_seed(1)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))
    plain.save_pretrained(tmp_path)
    if action == "load":  # the Hub layout of the interleaved family: one gate_up tensor per layer
        tensors = load_file(tmp_path / "model.safetensors")
        for i in range(2):
            pre = f"model.layers.{i}.mlp."
            gate, up = tensors.pop(pre + "gate_proj.weight"), tensors.pop(pre + "up_proj.weight")
            tensors[pre + "gate_up.weight"] = torch.stack([gate, up], 1).reshape(-1, gate.shape[1])
        from safetensors.torch import save_file

        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    before = _snapshot(tmp_path)
    needles = (["cannot be planned from the shapes", "LlamaForCausalLM", "conversion=None"]
               if action == "save, values needed" else
               ["Interleave", "model.layers.0.mlp.gate_up.weight", "no per-shard plan", "conversion=None"])
    for kind, message, changed in world(2).run(_refused, str(tmp_path), action, timeout=60):
        assert kind == "ConversionError", (kind, message)
        for needle in needles:
            assert needle in message, (needle, message)
        assert changed == [], changed
    assert _snapshot(tmp_path) == before  # nothing written, nothing removed


def _load_transposed(path: str) -> dict[str, torch.Tensor]:
    from fsdptk import gather_cpu_state_dict, load_safetensors

    model = _sharded(TransposedLlamaConfig)
    load_safetensors(model, path)
    return gather_cpu_state_dict(model, torch.distributed.get_rank() == 0)


@pytest.mark.parametrize("stored", ["as the model", "transposed"])
def test_transpose_with_check_dims_is_planned_from_the_shapes(world, tmp_path, stored):
    """``Transpose(check_dims=True)``: a tensor stored in the model's shape is read as it is, one
    stored transposed is transposed (transformers' own rule), each rank reading its box only."""
    torch.manual_seed(2)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))
    plain.save_pretrained(tmp_path)
    if stored == "transposed":
        from safetensors.torch import save_file

        tensors = load_file(tmp_path / "model.safetensors")
        tensors = {k: v.t().contiguous() if k.endswith("down_proj.weight") else v for k, v in tensors.items()}
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    got = world(2).run(_load_transposed, str(tmp_path), timeout=60)[0]
    want = plain.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


# ---------------------------------------------------------------------------------------------
# a mapping transformers registers by class name survives fully_shard's renamed class (issue 49, 11)
_NEOX = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
             tie_word_embeddings=False)


def _neox_round_trip(src: str, out: str) -> tuple[str, dict[str, torch.Tensor]]:
    from fsdptk import gather_cpu_state_dict, save_safetensors
    from fsdptk.hf import from_pretrained

    model = from_pretrained(src)  # shard_model, then a strict load of the Hub keys (embed_out.weight)
    save_safetensors(model, out)
    return type(model).__name__, gather_cpu_state_dict(model, torch.distributed.get_rank() == 0)


def test_a_mapping_registered_by_class_name_applies_after_shard_model(world, tmp_path):
    """transformers registers ``GPTNeoXForCausalLM``'s rule (``embed_out.`` in the files, ``lm_head.``
    in the model) by class name; ``fully_shard`` turns the root's class into ``FSDPGPTNeoXForCausalLM``
    (a torch module, so transformers would also skip it as custom code). The load and the save of the
    sharded model still follow the rule: the state transformers loads, and the file ``save_pretrained``
    wrote, key for key and bit for bit."""
    from fsdptk import load_safetensors, save_safetensors
    from fsdptk.hf import hf_meta_model

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.GPTNeoXConfig(**_NEOX)).save_pretrained(
        tmp_path / "src")
    hub = load_file(tmp_path / "src" / "model.safetensors")
    assert "embed_out.weight" in hub and "lm_head.weight" not in hub  # the rule is in play
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src").state_dict()
    plain = hf_meta_model(tmp_path / "src")  # before shard_model: one process, the same rule
    load_safetensors(plain, tmp_path / "src", strict=True)
    save_safetensors(plain, tmp_path / "plain")
    name, got = world(2).run(_neox_round_trip, str(tmp_path / "src"), str(tmp_path / "sharded"), timeout=120)[0]
    assert name == "FSDPGPTNeoXForCausalLM"
    for state in (got, plain.state_dict()):
        assert sorted(state) == sorted(want) and all(torch.equal(state[k], want[k]) for k in want)
    for saved in ("plain", "sharded"):
        back = load_file(tmp_path / saved / "model.safetensors")
        assert sorted(back) == sorted(hub) and all(torch.equal(back[k], hub[k]) for k in hub), saved
