"""The end-to-end example (examples/train_llama.py) on a 2-rank persistent world.

- an interrupted and resumed run reproduces the uninterrupted loss curve exactly (full and DCP
  optimizer checkpoints), and a run restarted after the last step only loads;
- the model saved as safetensors, loaded into a plain single-process model, gives the logits of the
  distributed model that wrote it (tied embeddings: the HF layout drops ``lm_head.weight``);
- tensor parallel + activation checkpointing + bf16 mixed precision run and save a loadable model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import bytedata  # noqa: E402
import llama  # noqa: E402
import train_llama  # noqa: E402

# a model of ~60 K parameters and 4 x 64-byte sequences per rank: a step takes milliseconds
TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "64", "--batch-size", "4", "--log-every", "2", "--warmup-steps", "2", "--no-progress"]


def _run(argv: list[str], probe: torch.Tensor | None = None) -> dict:
    """On every rank: run the example's main(); return picklable results (and probe logits)."""
    res = train_llama.main(argv)
    out = {"losses": res.losses, "checkpoint": res.checkpoint, "resumed_from": res.resumed_from,
           "final_step": res.final_step, "val_loss": res.val_loss}
    if probe is not None:
        res.model.eval()
        with torch.no_grad():
            out["logits"] = res.model(probe).detach().float().cpu()
    return out


def test_resume_reproduces_the_uninterrupted_loss_curve(world, tmp_path):
    w = world(2)
    common = TINY + ["--steps", "8", "--save-every", "4"]
    full = w.run(_run, common + ["--out-dir", str(tmp_path / "a")])
    cut = tmp_path / "b"
    first = w.run(_run, common + ["--out-dir", str(cut), "--stop-after", "4", "--optimizer-format", "dcp"])
    second = w.run(_run, common + ["--out-dir", str(cut), "--optimizer-format", "dcp"])
    again = w.run(_run, common + ["--out-dir", str(cut)])

    ref = full[0]["losses"]
    assert sorted(ref) == list(range(1, 9))
    assert full[0]["losses"] == full[1]["losses"]  # every rank reports the same global loss
    assert ref[8] < ref[1]  # it learns
    assert first[0]["final_step"] == 4 and first[0]["resumed_from"] is None
    assert sorted(first[0]["losses"]) == [1, 2, 3, 4]
    assert second[0]["resumed_from"] == 4 and sorted(second[0]["losses"]) == [5, 6, 7, 8]
    # bit-identical: same data for the same step, exact model and optimizer state after reload
    assert {**first[0]["losses"], **second[0]["losses"]} == ref
    assert second[0]["val_loss"] == full[0]["val_loss"]
    # a restart after the last step loads the final checkpoint and trains nothing
    assert again[0]["resumed_from"] == 8 and again[0]["losses"] == {}
    assert again[0]["val_loss"] == second[0]["val_loss"]
    assert Path(second[0]["checkpoint"]).name == "step_000008"
    kept = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000008"]  # --keep 2, no temporary directories left
    assert (cut / "checkpoints" / "step_000008" / "dcp" / ".metadata").is_file()
    history = train_llama.read_train_state(cut / "checkpoints" / "step_000008")["losses"]
    assert {int(k): v for k, v in history.items()} == ref  # the saved history spans both runs


def test_saved_safetensors_give_the_distributed_logits_in_a_plain_model(world, tmp_path):
    probe = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    argv = TINY + ["--steps", "3", "--save-every", "3", "--tie-embeddings", "--out-dir", str(tmp_path)]
    res = world(2).run(_run, argv, probe)
    torch.testing.assert_close(res[0]["logits"], res[1]["logits"], rtol=0, atol=0)

    plain = train_llama.load_plain_model(res[0]["checkpoint"])
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in plain.parameters())
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # the tie survives the round trip
    with torch.no_grad():
        logits = plain(probe)
    torch.testing.assert_close(logits, res[0]["logits"], rtol=1e-5, atol=1e-5)
    # and the weights did change from the initial checkpoint (so this compares trained models)
    init = train_llama.load_plain_model(tmp_path / "init")
    assert not torch.equal(init.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_init_from_a_sharded_hf_directory(world, tmp_path):
    """--init-from takes any HF-layout directory: here an index + 3 files, tied weight stored once."""
    import fsdptk

    cfg = llama.LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=True)
    src = llama.LlamaForCausalLM(cfg)
    src.init_weights(seed=7)
    hf = tmp_path / "hf"
    fsdptk.save_safetensors(src, hf, max_shard_size="40KB")  # single process: no process group
    cfg.save(hf)
    assert (hf / "model.safetensors.index.json").is_file() and len(list(hf.glob("*.safetensors"))) > 1
    probe = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    argv = TINY + ["--init-from", str(hf), "--steps", "1", "--lr", "0", "--min-lr", "0",
                   "--weight-decay", "0", "--out-dir", str(tmp_path / "run")]
    res = world(2).run(_run, argv, probe)  # lr 0: the weights stay those of the directory
    with torch.no_grad():
        torch.testing.assert_close(res[0]["logits"], src(probe), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [
    ["--tp", "2", "--activation-checkpointing", "--mixed-precision", "bf16"],
    ["--dp-replicate", "2", "--prefetch", "2", "--no-reshard-after-forward"],  # HSDP: 2 replicas of 1 shard
], ids=["tp-ac-bf16", "hsdp-prefetch"])
def test_parallelism_and_memory_options(world, tmp_path, flags):
    argv = TINY + ["--steps", "3", "--save-every", "3", "--out-dir", str(tmp_path), *flags]
    res = world(2).run(_run, argv)
    losses = res[0]["losses"]
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    plain = train_llama.load_plain_model(res[0]["checkpoint"])  # TP shards gathered into full tensors
    assert plain.model.layers[0].self_attn.num_heads == 4  # the saved config is the global one
    assert plain.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)


def test_sync_save_flag_writes_the_same_checkpoint(world, tmp_path):
    """Background saves are the default; --sync-save writes the same files synchronously."""
    argv = TINY + ["--steps", "2", "--save-every", "2"]
    bg = world(2).run(_run, argv + ["--out-dir", str(tmp_path / "bg")])
    sync = world(2).run(_run, argv + ["--out-dir", str(tmp_path / "sync"), "--sync-save"])
    a, b = (train_llama.load_plain_model(r[0]["checkpoint"]) for r in (bg, sync))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert sorted(p.name for p in Path(bg[0]["checkpoint"]).iterdir()) == \
        sorted(p.name for p in Path(sync[0]["checkpoint"]).iterdir())


# -- single-process pieces ---------------------------------------------------------------------
def test_model_forward_shapes_and_causality():
    model = llama.LlamaForCausalLM(llama.LlamaConfig(hidden_size=32, num_hidden_layers=2))
    model.init_weights(seed=3)
    x = torch.randint(0, 256, (2, 10))
    y = model(x)
    assert y.shape == (2, 10, 256)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 256  # changing the last token changes no earlier position
    torch.testing.assert_close(model(x2)[:, :-1], y[:, :-1])
    assert not torch.allclose(model(x2)[:, -1], y[:, -1])


def test_rope_cache_is_non_persistent_and_reset_buffers_recomputes_it():
    cfg = llama.LlamaConfig(hidden_size=32, num_hidden_layers=1)
    ref = llama.LlamaForCausalLM(cfg)
    assert not any("rotary" in k for k in ref.state_dict())
    with torch.device("meta"):
        model = llama.LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")  # garbage in every tensor, as after meta init
    model.model.rotary_emb.cos.fill_(float("nan"))
    model.load_state_dict(ref.state_dict())
    llama.reset_non_persistent_buffers(model)
    torch.testing.assert_close(model.model.rotary_emb.cos, ref.model.rotary_emb.cos)
    x = torch.randint(0, 256, (1, 8))
    torch.testing.assert_close(model(x), ref(x))


def test_config_round_trips_through_hf_config_json(tmp_path):
    cfg = llama.LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True)
    cfg.save(tmp_path)
    assert llama.LlamaConfig.load(tmp_path) == cfg
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be divisible by num_key_value_heads \(4\)"):
        llama.LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=4)


def test_step_batches_are_a_function_of_the_step_and_disjoint_across_ranks():
    data = torch.arange(2000, dtype=torch.int64) % 256
    ds = bytedata.ByteWindows(data.to(torch.uint8), 16)
    r0 = bytedata.StepBatches(ds, 3, dp_size=2, dp_rank=0, seed=5)
    r1 = bytedata.StepBatches(ds, 3, dp_size=2, dp_rank=1, seed=5)
    late = bytedata.StepBatches(ds, 3, dp_size=2, dp_rank=0, seed=5)
    for step in (0, 1, r0.steps_per_epoch + 2, 0):  # later epochs too, and back
        x0, y0 = r0(step)
        assert torch.equal(x0, late(step)[0])  # a fresh object (a resumed run) sees the same batch
        assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one
        rows0 = {tuple(r.tolist()) for r in x0}
        assert rows0.isdisjoint({tuple(r.tolist()) for r in r1(step)[0]})
    assert not torch.equal(r0(0)[0], r0(r0.steps_per_epoch)[0])  # reshuffled each epoch
    with pytest.raises(ValueError, match="more than the"):
        bytedata.StepBatches(ds, 1000, dp_size=2, dp_rank=0, seed=0)
