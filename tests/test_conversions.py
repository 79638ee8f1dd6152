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
