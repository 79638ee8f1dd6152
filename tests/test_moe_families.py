"""Every Mixture-of-Experts family docs/layouts.md names, with transformers' own tiny config (issue 40).

tests/test_hf_moe.py covers Mixtral, Qwen3-MoE, DeepSeek-V3 and gpt-oss in depth (FSDP, HSDP, TP
but for gpt-oss, a training step, reads per rank). Here each other family the docs name (MiniMax, Qwen2-MoE,
DeepSeek-V2, GLM-4.5, OLMoE, Ernie 4.5, dots1) is written with ``save_pretrained`` (the Hub layout:
one tensor per expert) and, at 2 gloo ranks (FSDP):

- ``fsdptk.hf.from_pretrained`` reads it into the fused 3-D experts (``Shard(0)``, 4 of the 8
  experts per rank); the logits equal transformers' single-process ``from_pretrained`` of the same
  directory on the same input;
- ``save_safetensors(model, dir, conversion="auto")`` writes the tensors ``save_pretrained`` wrote:
  the same names, shapes, dtypes and bytes.

gpt-oss under FSDP x TP (2 x 2, the model's own TP plan) at 4 ranks: the logits, a training step
and the saved tensors against the single-process model, as tests/test_hf_moe.py does for the
other families under TP.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_moe import (  # noqa: E402
    _ATOL,
    _batch,
    _files,
    _logits,
    assert_like_the_reference,
    build_reference,
    sgd_step,
)

# family -> (transformers config class, its MoE sizes: 8 experts of intermediate size 16, a
# dense first layer and a shared expert where the family has them)
FAMILIES = {
    "minimax": ("MiniMaxConfig", {"num_local_experts": 8, "intermediate_size": 16, "head_dim": 16,
                                  "block_size": 16}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 8, "moe_intermediate_size": 16, "intermediate_size": 64,
                                     "shared_expert_intermediate_size": 32}),
    "deepseek_v2": ("DeepseekV2Config", {"n_routed_experts": 8, "moe_intermediate_size": 16,
                                         "intermediate_size": 64, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                         "n_group": 2, "topk_group": 1, "num_key_value_heads": 4}),
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 8, "moe_intermediate_size": 16, "intermediate_size": 64,
                                   "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                                   "topk_group": 1, "head_dim": 16}),
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "intermediate_size": 16}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 16,
                                            "intermediate_size": 64, "moe_num_shared_experts": 1,
                                            "moe_layer_start_index": 1, "head_dim": 16}),
    "dots1": ("Dots1Config", {"n_routed_experts": 8, "moe_intermediate_size": 16, "intermediate_size": 64,
                              "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                              "head_dim": 16}),
}


def _config(family: str):
    cls, extra = FAMILIES[family]
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=250, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, cls)(**{**kw, **extra})


def _hub(tmp_path_factory, family: str) -> tuple[str, torch.Tensor]:
    """A save_pretrained directory of ``family`` and transformers' single-process logits."""
    root = tmp_path_factory.mktemp(family)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(family)).save_pretrained(root)
    model = transformers.AutoModelForCausalLM.from_pretrained(root)
    return str(root), _logits(model, _batch())


# ---------------------------------------------------------------------------------------------
# run on every rank
def _load_and_save(src: str, out: str) -> dict:
    from fsdptk import save_safetensors
    from fsdptk.hf import from_pretrained

    model = from_pretrained(src)
    experts = next(p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    save_safetensors(model, out, conversion="auto")
    return {"logits": _logits(model, _batch()), "experts": (tuple(experts.shape),
                                                             tuple(repr(p) for p in experts.placements),
                                                             tuple(experts.to_local().shape))}


def _tp_load_train_save(src: str, out: str) -> dict:
    from fsdptk import ParallelDims, save_safetensors
    from fsdptk.hf import from_pretrained, hf_meta_model, hf_tp_plan

    dims = ParallelDims(dp_shard=2, tp=2)
    model = from_pretrained(src, dims=dims)
    tp = {n: tuple(repr(p) for p in t.placements) for n, t in model.named_parameters()
          if "tp" in (t.device_mesh.mesh_dim_names or ())}  # (dp_shard, tp) placements
    meta = hf_meta_model(model.config)  # the release's own plan, read on an untouched build
    planned = sorted(f"{m}.{n}" for m in hf_tp_plan(meta) for n, _ in meta.get_submodule(m).named_parameters(recurse=False)
                     if f"{m}.{n}" in dict(meta.named_parameters()))
    experts = model.model.layers[1].mlp.experts.gate_up_proj
    batch = _batch()
    loaded = _logits(model, batch)
    save_safetensors(model, f"{out}/as-loaded", conversion="auto")
    loss = sgd_step(model, batch, dims.dp_degree, dims.dp_rank)
    trained = _logits(model, batch)
    save_safetensors(model, f"{out}/trained")
    return {"loaded": loaded, "loss": loss, "trained": trained, "tp": tp, "planned": planned,
            "experts": (experts.device_mesh.mesh_dim_names, tuple(repr(p) for p in experts.placements))}


# ---------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hub_layout_loads_at_two_ranks_and_saves_back_bit_for_bit(world, tmp_path_factory, tmp_path, family):
    src, logits = _hub(tmp_path_factory, family)
    hub = _files(src)
    assert any(".experts.0." in k for k in hub), sorted(hub)  # per-expert tensors: a conversion to run
    results = world(2).run(_load_and_save, src, str(tmp_path / "saved"), timeout=120)
    for rank, r in enumerate(results):
        diff = (r["logits"] - logits).abs().max().item()
        assert diff <= _ATOL, f"{family}: rank {rank}'s logits differ from transformers' by {diff}"
        shape, placements, local = r["experts"]
        assert shape[0] == 8 and placements == ("Shard(dim=0)",) and local[0] == 4, r["experts"]
    saved = _files(tmp_path / "saved")
    assert sorted(saved) == sorted(hub)
    for k, t in hub.items():
        assert (saved[k].dtype, saved[k].shape) == (t.dtype, t.shape), k
        assert torch.equal(_bits(saved[k]), _bits(t)), k


def test_gpt_oss_under_fsdp_and_tp_with_its_own_plan(world, tmp_path_factory, tmp_path):
    """gpt-oss at 4 ranks, ``dims=ParallelDims(dp_shard=2, tp=2)``: transformers' plan for it
    (transformers 5.23: ``lm_head`` colwise, output gathered; 5.24 adds the vocab-parallel
    embedding; the experts and attention stay whole on the TP ranks and FSDP shards them) gives the
    single-process logits, step loss and trained logits, and the save writes the checkpoint's own
    tensors. Exactly the parameters the installed release's plan names are tensor-parallel."""
    ref = build_reference(tmp_path_factory, "gpt_oss")
    results = world(4).run(_tp_load_train_save, str(ref["src"]), str(tmp_path), timeout=120)
    for r in results:
        assert_like_the_reference(r, ref)
        assert sorted(r["tp"]) == r["planned"] and "lm_head.weight" in r["tp"], (r["tp"], r["planned"])
        assert all(p[1].startswith("Shard(") for p in r["tp"].values()), r["tp"]
        assert r["experts"] == (("dp_shard",), ("Shard(dim=0)",)), r["experts"]
    hub, saved = _files(ref["src"]), _files(tmp_path / "as-loaded")
    assert sorted(saved) == sorted(hub)
    for k, t in hub.items():
        assert (saved[k].dtype, saved[k].shape) == (t.dtype, t.shape), k
        assert torch.equal(_bits(saved[k]), _bits(t)), k
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    assert (_logits(model, _batch()) - results[0]["trained"]).abs().max().item() <= _ATOL
