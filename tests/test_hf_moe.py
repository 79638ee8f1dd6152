"""Mixture-of-Experts checkpoints as the Hub ships them, with the real transformers models
(Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss; tiny configs written with ``save_pretrained`` here,
nothing downloaded), on 2 gloo ranks (FSDP) and 4 (HSDP 2 x 2; FSDP x TP 2 x 2 with the model's
own TP plan, ``moe_tp_experts`` included):

- ``fsdptk.hf.from_pretrained`` reads the per-expert Hub layout into the fused 3-D experts; the
  logits equal transformers' single-process load of the same directory, and a training step's
  whole-batch loss equals the single-process loss;
- ``save_safetensors`` writes exactly the keys and tensors ``save_pretrained`` wrote (the Hub
  layout), and after the step a directory transformers loads with the trained logits;
  ``conversion=None`` writes the model's own (fused) keys;
- each rank reads only its experts' per-expert tensors, and under TP only its rows of each;
- a missing per-expert tensor, and tensors that do not stack, are one error on every rank naming
  the key (and both shapes), before the model changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fsdptk.hf import from_pretrained  # noqa: E402

from _counting import file_reads, raised  # noqa: E402

_ATOL = 1e-5
_LR = 1e-2
_BATCH, _SEQ = 4, 8
FAMILIES = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "moe_intermediate_size": 16,
                                     "intermediate_size": 64, "head_dim": 16}),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 8, "moe_intermediate_size": 16,
                                         "intermediate_size": 64, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "q_lora_rank": 32,
                                         "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 2,
                                         "topk_group": 1, "num_key_value_heads": 4}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 8, "intermediate_size": 32, "head_dim": 16}),
}
LAYOUTS = [(2, None, f) for f in FAMILIES]
LAYOUTS += [(4, {"dp_replicate": 2, "dp_shard": 2}, f) for f in FAMILIES]
LAYOUTS += [(4, {"dp_shard": 2, "tp": 2}, f) for f in ("mixtral", "qwen3_moe", "deepseek_v3")]
_IDS = [f"{n}ranks-{'fsdp' if d is None else 'tp' if 'tp' in d else 'hsdp'}-{f}" for n, d, f in LAYOUTS]


def _config(family: str):
    cls, extra = FAMILIES[family]
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=250, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, cls)(**{**kw, **extra})


def _batch() -> torch.Tensor:
    return torch.randint(3, 250, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(7))


_REFS: dict[str, dict] = {}


def build_reference(tmp_path_factory, family: str) -> dict:
    """A save_pretrained directory of ``family`` (the Hub layout), transformers' single-process
    logits and whole-batch loss, and its logits and state dict after one SGD step (built once per
    session; tests/test_ep.py uses it too)."""
    if family not in _REFS:
        root = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_config(family)).save_pretrained(root)
        model = transformers.AutoModelForCausalLM.from_pretrained(root)
        batch = _batch()
        with torch.no_grad():
            logits = model(input_ids=batch).logits
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=_LR)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        model.eval()
        _REFS[family] = {"src": root, "logits": logits, "loss": loss.item(),
                         "trained": _logits(model, batch),
                         "trained_sd": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return _REFS[family]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> :func:`build_reference`."""
    return lambda family: build_reference(tmp_path_factory, family)


def _files(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _logits(model, batch):
    with torch.no_grad():
        out = model(input_ids=batch).logits
    return out.full_tensor() if hasattr(out, "full_tensor") else out


# ---------------------------------------------------------------------------------------------
# run on every rank
def sgd_step(model, batch: torch.Tensor, dp_size: int, dp_rank: int) -> float:
    """One SGD step of ``model`` on this data-parallel rank's rows of ``batch``; the mean of the
    ranks' losses (the whole-batch loss when every rank holds as many rows). Leaves it in eval."""
    import torch.distributed as dist

    model.train()
    per = _BATCH // dp_size
    rows = batch[dp_rank * per:(dp_rank + 1) * per]
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    opt.step()
    loss = loss.detach()
    dist.all_reduce(loss)
    model.eval()
    return loss.item() / dist.get_world_size()


def _load_train_save(src: str, dims_kw, out: str) -> dict:
    import torch.distributed as dist

    from fsdptk import ParallelDims, save_safetensors

    dims = None if dims_kw is None else ParallelDims(**dims_kw)
    model = from_pretrained(src, dims=dims)
    batch = _batch()
    loaded = _logits(model, batch)
    experts = model.model.layers[1].mlp.experts.gate_up_proj
    placements = (experts.device_mesh.mesh_dim_names, tuple(repr(p) for p in experts.placements))
    save_safetensors(model, f"{out}/as-loaded")
    save_safetensors(model, f"{out}/fused", conversion=None)

    dp_size = dist.get_world_size() if dims is None else dims.dp_degree
    dp_rank = dist.get_rank() if dims is None else dims.dp_rank
    loss = sgd_step(model, batch, dp_size, dp_rank)
    trained = _logits(model, batch)
    save_safetensors(model, f"{out}/trained")
    return {"loaded": loaded, "loss": loss, "trained": trained,
            "placements": placements}


def _error(src: str) -> tuple[str, str]:
    return raised(from_pretrained, src)


def _reads(src: str, dims_kw) -> list[tuple[str, tuple[int, ...], int]]:
    """(checkpoint key, shape read, bytes) of every read this rank makes from the files."""
    from fsdptk import ParallelDims

    with file_reads() as seen:
        from_pretrained(src, dims=None if dims_kw is None else ParallelDims(**dims_kw))
    return seen


# ---------------------------------------------------------------------------------------------
def assert_like_the_reference(r: dict, ref: dict) -> None:
    """One rank's loaded logits, step loss and trained logits against the single-process model's."""
    diff = (r["loaded"] - ref["logits"]).abs().max().item()
    assert diff <= _ATOL, f"logits differ from transformers' single-process load by {diff}"
    assert r["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    diff = (r["trained"] - ref["trained"]).abs().max().item()
    assert diff <= 1e-4, f"after one step the logits differ from the single-process step's by {diff}"


@pytest.mark.parametrize("ranks, dims_kw, family", LAYOUTS, ids=_IDS)
def test_hub_layout_loads_trains_and_saves_back(world, reference, tmp_path, ranks, dims_kw, family):
    ref = reference(family)
    results = world(ranks).run(_load_train_save, str(ref["src"]), dims_kw, str(tmp_path))
    for r in results:
        assert_like_the_reference(r, ref)
        names, placements = r["placements"]
        if dims_kw and "tp" in dims_kw:
            assert names == ("dp_shard", "tp") and "_StridedShard(dim=1" in placements[1]
        assert placements[names.index("dp_shard")] == "Shard(dim=0)"
    hub, saved = _files(ref["src"]), _files(tmp_path / "as-loaded")
    assert sorted(saved) == sorted(hub)  # save_pretrained's keys, per-expert where it writes them
    assert all(torch.equal(saved[k], hub[k]) for k in hub)
    fused = _files(tmp_path / "fused")
    plain = transformers.AutoModelForCausalLM.from_pretrained(ref["src"])
    assert sorted(fused) == sorted(plain.state_dict())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (_logits(model, _batch()) - results[0]["trained"]).abs().max().item() <= _ATOL
    assert not torch.equal(results[0]["trained"], results[0]["loaded"])  # the step changed it


@pytest.mark.parametrize("dims_kw, share", [(None, 4), ({"dp_shard": 2, "tp": 2}, 4)],
                         ids=["4ranks-fsdp", "4ranks-tp"])
def test_each_rank_reads_only_its_experts(world, reference, dims_kw, share):
    """8 experts over 4 FSDP ranks: each rank reads 2 experts' per-expert tensors, no other; with
    TP 2 x FSDP 2 each reads 4 experts' tensors, half of each tensor's rows: a quarter of the
    experts' bytes either way."""
    ref = reference("qwen3_moe")
    hub = _files(ref["src"])
    expert_bytes = sum(t.numel() * t.element_size() for k, t in hub.items() if ".experts." in k)
    per_rank = world(4).run(_reads, str(ref["src"]), dims_kw)
    for seen in per_rank:
        read = [(k, s, n) for k, s, n in seen if ".experts." in k]
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k, _, _ in read}
        assert len(experts) == (2 if dims_kw is None else 4), sorted(experts)
        assert sum(n for _, _, n in read) == expert_bytes // share
        for k, shape, _ in read:
            full = tuple(hub[k].shape)
            if dims_kw is None:
                assert shape == full
            elif "down_proj" in k:  # rowwise: half of the intermediate columns
                assert shape == (full[0], full[1] // 2)
            else:  # gate and up: half of the rows of each
                assert shape == (full[0] // 2, full[1])


def _rewrite(src: Path, dst: Path, change) -> None:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = _files(src)
    change(tensors)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _same_on_every_rank(results, kind: str, *needles: str) -> None:
    for r in results:
        assert r[0] == kind, r
        for n in needles:
            assert n in r[1], (n, r[1])


def test_missing_per_expert_tensor_is_named_on_every_rank(world, reference, tmp_path):
    ref = reference("qwen3_moe")
    missing = "model.layers.1.mlp.experts.7.up_proj.weight"
    _rewrite(ref["src"], tmp_path / "ckpt", lambda t: t.pop(missing))
    _same_on_every_rank(world(2).run(_error, str(tmp_path / "ckpt")), "ConversionError", missing)


def test_tensors_that_do_not_stack_name_both_shapes(world, reference, tmp_path):
    ref = reference("mixtral")
    bad = "model.layers.0.block_sparse_moe.experts.3.w2.weight"

    def change(t):
        t[bad] = t[bad][:, :-1].clone()

    _rewrite(ref["src"], tmp_path / "ckpt", change)
    results = world(2).run(_error, str(tmp_path / "ckpt"))
    _same_on_every_rank(results, "ConversionError", bad, "[64, 31]", "[64, 32]")


def _rank0_reads_async_save_and_transformers(src: str, out: str) -> dict:
    import importlib.util

    import torch.distributed as dist

    from fsdptk import save_safetensors_async

    model = from_pretrained(src, shard_on_read=False)  # rank 0 reads through the conversion, sends
    ours = _logits(model, _batch())
    save_safetensors_async(model, out).wait()  # the Hub layout, split in the background
    theirs = None
    if importlib.util.find_spec("accelerate") is not None:
        from transformers.distributed import DistributedConfig

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            src, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size()))
        theirs = _logits(hf, _batch())
    return {"ours": ours, "theirs": theirs}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_rank0_read_background_save_and_transformers_distributed_load(world, reference, tmp_path, family):
    ref = reference(family)
    for r in world(2).run(_rank0_reads_async_save_and_transformers, str(ref["src"]), str(tmp_path)):
        assert (r["ours"] - ref["logits"]).abs().max().item() <= _ATOL
        if r["theirs"] is not None:  # transformers' own distributed load of the same directory
            assert (r["ours"] - r["theirs"]).abs().max().item() <= _ATOL
    hub, saved = _files(ref["src"]), _files(tmp_path)
    assert sorted(saved) == sorted(hub) and all(torch.equal(saved[k], hub[k]) for k in hub)
