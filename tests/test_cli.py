"""The ``fsdptk`` command line: outputs and exit codes (0 ok, 1 bad path, 2 bad arguments)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdptk.cli import inspect_checkpoint, main

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 3, generator=g),
        "layers.0.w": torch.randn(5, generator=g).to(torch.bfloat16),
        "layers.0.count": torch.tensor([1, 2, 3], dtype=torch.int64),
    }


# -- inspect -------------------------------------------------------------------------------------
def test_inspect_safetensors_lists_keys_shapes_dtypes_and_total(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), str(path))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "embed.weight" in out and "(7, 3)" in out and "bfloat16" in out and "int64" in out
    total = 7 * 3 * 4 + 5 * 2 + 3 * 8
    assert "total: 3 tensors, 29 elements" in out and f"({total:,} bytes)" in out

    assert main(["inspect", str(tmp_path), "--json", "--filter", "layers.*"]) == 0  # a directory
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "safetensors" and doc["num_tensors"] == 2
    assert {t["key"]: (t["dtype"], t["shape"], t["nbytes"]) for t in doc["tensors"]} == {
        "layers.0.w": ("bfloat16", [5], 10), "layers.0.count": ("int64", [3], 24)}


def test_inspect_dcp_directory_and_torch_save_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = _tensors()
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    fmt, infos = inspect_checkpoint(tmp_path / "dcp")
    assert fmt == "dcp"
    assert {i["key"]: (i["dtype"], i["shape"]) for i in infos} == {
        k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in sd.items()}

    torch.save({"state": {"w": {"exp_avg": torch.zeros(2, 2), "step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 0.1, "params": ["w"]}]}, tmp_path / "opt.pt")
    fmt, infos = inspect_checkpoint(tmp_path / "opt.pt")
    assert fmt == "torch"
    assert [(i["key"], i["shape"], i["nbytes"]) for i in infos] == [
        ("state.w.exp_avg", [2, 2], 16), ("state.w.step", [], 4)]


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.safetensors", "no such file or directory"),
    (lambda d: d, "neither *.safetensors files nor a DCP .metadata"),
    (lambda d: (d / "x.txt").write_text("hi") and d / "x.txt", "unknown checkpoint type"),
    (lambda d: (d / "bad.safetensors").write_bytes(b"\x05") and d / "bad.safetensors", "not a readable safetensors"),
])
def test_inspect_bad_paths_exit_1_with_a_message(tmp_path, capsys, make, message):
    path = make(tmp_path)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fsdptk inspect: error:") and message in err and str(path) in err


# -- arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    [], ["nope"], ["inspect"], ["plan", "examples.llama:tiny"], ["plan", "m:f", "--world-size", "0"],
    ["inspect", "x", "--bogus"], ["convert", "a", "b", "--to", "zip"], ["demo", "--nproc", "0"],
])
def test_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage: fsdptk" in capsys.readouterr().err


# -- plan ----------------------------------------------------------------------------------------
def test_plan_reports_the_units_describe_sharding_computes(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["plan", "examples.llama:tiny", "--world-size", "4",
                 "--kwargs", '{"num_hidden_layers": 3}']) == 0
    out = capsys.readouterr().out
    from fsdptk import describe_sharding, get_shard_conditions

    sys.path.insert(0, str(REPO))
    from examples.llama import tiny

    with torch.device("meta"):
        model = tiny(num_hidden_layers=3)
    assert out.strip() == str(describe_sharding(model, [get_shard_conditions], world_size=4)).strip()
    assert "model.layers.2" in out and "model.layers.3" not in out

    assert main(["plan", "examples.llama:tiny", "--world-size", "2", "--glob", "model.embed_tokens"]) == 0
    assert "model.embed_tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "no_colon", "--world-size", "2"], "MODULE:FACTORY"),
    (["plan", "no_such_module_xyz:f", "--world-size", "2"], "cannot import module 'no_such_module_xyz'"),
    (["plan", "examples.llama:nope", "--world-size", "2"], "has no attribute 'nope'"),
    (["plan", "examples.llama:tiny", "--world-size", "2", "--kwargs", "{bad"], "--kwargs is not valid JSON"),
    (["plan", "examples.llama:tiny", "--world-size", "2", "--no-layers"], "no shard condition"),
])
def test_plan_errors_exit_1(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_plan_ep_prints_both_meshes_and_what_each_rank_holds(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_experts=8, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, vocab_size=64)
    cfg.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--world-size", "4", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "Expert parallel: ep 2 (the model's own ep_plan: 2 experts modules of 8 experts)" in out
    assert "dense mesh:  dp_shard 4" in out and "expert mesh: efsdp 2 x ep 2" in out
    expert_bytes = 2 * 8 * (2 * 16 * 32 + 32 * 16) * 4  # 2 layers, 8 experts, gate_up + down, fp32
    assert f"of the experts' {expert_bytes // 1024:.2f} KiB" in out
    assert "4 whole experts of each module" in out
    assert main(["plan", str(tmp_path), "--world-size", "4", "--ep", "3"]) == 1
    assert "ep (3) must divide dp_shard * tp (4 * 1 = 4)" in capsys.readouterr().err
    # the experts' own count: the one check fsdptk.hf.from_pretrained and apply_ep run too
    assert main(["plan", str(tmp_path), "--world-size", "6", "--ep", "3"]) == 1
    assert ("experts module 'model.layers.0.mlp.experts' (Qwen3MoeExperts): ep (3) must divide its number "
            "of experts (8)") in capsys.readouterr().err


# -- convert -------------------------------------------------------------------------------------
def test_convert_round_trips_safetensors_through_dcp(tmp_path, capsys):
    sd = _tensors()
    save_file(sd, str(tmp_path / "m.safetensors"))
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "dcp")]) == 0
    assert inspect_checkpoint(tmp_path / "dcp")[0] == "dcp"
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    files = list((tmp_path / "back").glob("*.safetensors")) if (tmp_path / "back").is_dir() else [tmp_path / "back"]
    back = {}
    for f in files:
        back.update(load_file(str(f)))
    assert back.keys() == sd.keys()
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k])


def test_convert_bad_source_exits_1(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--to", "safetensors"]) == 1
    assert "not a DCP checkpoint directory" in capsys.readouterr().err


# -- demo and the entry points (real subprocesses) -----------------------------------------------
def test_demo_bad_script_exits_1(tmp_path, capsys):
    assert main(["demo", "--script", str(tmp_path / "none.py")]) == 1
    assert "example script not found" in capsys.readouterr().err


def test_demo_runs_the_example_on_two_processes_and_resumes(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [PY, "-m", "fsdptk", "demo", "--nproc", "2", "--interrupt-at", "2", "--out-dir", str(tmp_path),
           "--steps", "3", "--save-every", "2", "--dim", "32", "--layers", "1", "--ffn-dim", "64",
           "--seq-len", "32", "--batch-size", "2", "--log-every", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[demo] run 1/2 (interrupted at step 2)" in out and "[demo] run 2/2 (resumed)" in out
    assert "stopped at step 2/3; run again to resume" in out
    assert f"resumed from {tmp_path}/checkpoints/step_000002 at step 2" in out
    assert f"saved checkpoint: {tmp_path}/checkpoints/step_000003" in out


def test_module_entry_point_and_import_fsdptk_does_not_load_the_cli():
    proc = subprocess.run([PY, "-m", "fsdptk"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "usage: fsdptk" in proc.stderr
    code = "import sys, fsdptk; fsdptk.get_world_size_and_rank; print('fsdptk.cli' in sys.modules)"
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


def test_convert_a_plain_dcp_directory_needs_the_right_prefix(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    sd = _tensors()
    dcp.save(sd, checkpoint_id=str(tmp_path / "raw"), no_dist=True)  # keys without "model."
    assert main(["convert", str(tmp_path / "raw"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fsdptk convert: error:") and "model." in err
    assert main(["convert", str(tmp_path / "raw"), str(tmp_path / "out"), "--prefix", ""]) == 0
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_inspect_resolves_a_directory_as_the_loader_does(tmp_path, capsys):
    from fsdptk._files.safetensors_writer import ShardedWriter

    sd = {f"layers.{i}.w": torch.full((4, 8), float(i)) for i in range(4)}
    w = ShardedWriter(tmp_path, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=300)
    for k, v in sd.items():
        w.write(k, v)
    w.commit()
    index = tmp_path / "model.safetensors.index.json"
    for path in (tmp_path, index):  # the directory, or its index: the files the index names
        fmt, infos = inspect_checkpoint(path)
        assert fmt == "safetensors" and sorted(i["key"] for i in infos) == sorted(sd)
    save_file({"new": torch.zeros(2)}, str(tmp_path / "model.safetensors"))  # the index is now stale
    assert [i["key"] for i in inspect_checkpoint(tmp_path)[1]] == ["new"]
    assert main(["inspect", str(tmp_path / "nope.safetensors.index.json")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_convert_quantize_writes_an_fp8_release_one_tensor_at_a_time(tmp_path, capsys):
    """``fsdptk convert SRC DST --quantize fp8-ue8m0 --block-size 32,32``: a Hub checkpoint (a
    tiny Qwen3-MoE, one tensor per expert) -> an FP8 release whose bytes are the quantizer's
    (vLLM's arithmetic) and whose config carries the quantization_config; the source is untouched;
    a DCP checkpoint of the model (with --config) gives the same release; bad input exits 1."""
    transformers = pytest.importorskip("transformers")
    from fsdptk import save_dcp
    from fsdptk._engine.sources.quantize import fp8_block_quantize

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, vocab_size=128, num_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "hub")
    before = {p.name: p.read_bytes() for p in (tmp_path / "hub").iterdir()}
    argv = ["convert", str(tmp_path / "hub"), str(tmp_path / "fp8"), "--quantize", "fp8-ue8m0", "--block-size", "32,32"]
    assert main(argv) == 0
    assert "wrote fp8-ue8m0 release" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in (tmp_path / "hub").iterdir()} == before  # source untouched
    hub = load_file(tmp_path / "hub" / "model.safetensors")
    out = load_file(tmp_path / "fp8" / "model.safetensors")
    quantized = [k for k in hub if k.endswith("_proj.weight")]
    assert any(".experts.3." in k for k in quantized)
    for k, t in hub.items():
        if k in quantized:
            q, s = fp8_block_quantize(t, (32, 32), ue8m0=True)
            assert torch.equal(out[k].view(torch.uint8), q.view(torch.uint8)), k
            assert torch.equal(out[k.removesuffix(".weight") + ".weight_scale_inv"], s), k
        else:
            assert torch.equal(out[k], t), k
    written = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "fp8" and written["scale_fmt"] == "ue8m0"
    assert written["weight_block_size"] == [32, 32] and "model.layers.0.mlp.gate" in written["modules_to_not_convert"]

    save_dcp(model, tmp_path / "dcp")
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "from_dcp"), "--config", str(tmp_path / "hub"),
                 "--quantize", "fp8-ue8m0", "--block-size", "32,32"]) == 0
    from_dcp = load_file(tmp_path / "from_dcp" / "model.safetensors")
    assert from_dcp.keys() == out.keys() and all(torch.equal(from_dcp[k].view(torch.uint8), out[k].view(torch.uint8))
                                                 for k in out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "fp8", "from_dcp", "hub"]  # no staging left
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hub"), str(tmp_path / "x"), "--quantize", "mxfp4"]) == 1
    assert "mxfp4" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "y"), "--quantize", "fp8"]) == 1
    assert "already a quantized release" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "hub"), str(tmp_path / "z"), "--quantize", "fp8", "--block-size", "0,32"]) == 1
    assert "block_size" in capsys.readouterr().err
