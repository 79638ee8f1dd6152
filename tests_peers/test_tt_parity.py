"""Behaviour parity with the real torchtune 0.6.1 at 2 ranks over gloo.

Each case builds the same tiny torchtune model twice on ``meta`` (torchtune's ``lora_llama2``
component builder: LoRA, DoRA, and QLoRA with NF4 base weights), drives one copy with
``torchtune.training``'s functions and the other with fsdptk's, called the same way, and compares
everything a training loop can observe: the shards after a load (bytes, dtypes, placements, NF4
inner tensors), what each load returns, what the caller's dict holds afterwards, the gathered
state dicts (full and adapter-only), two AdamW steps, and the optimizer state round trip. The
comparisons are bit-identical (:func:`ttparity.same`), never a tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ttparity import (
    diff_keys,
    lora_model,
    param_facts,
    random_full_state_dict,
    rope_init,
    same,
    split,
)

CPU = torch.device("cpu")
VARIANTS = {  # name -> (quantize, dtype, extra builder kwargs); "+ac": activation checkpointing
    "lora": (False, torch.float32, {}),
    "dora": (False, torch.float32, {"use_dora": True}),
    "qlora": (True, torch.bfloat16, {}),
    "qlora+ac": (True, torch.bfloat16, {}),
}


# ---------------------------------------------------------------------------------------------
# run on every rank


def _build(variant: str, shard_fn, reshard: bool = True, ac: bool = False):
    import torchtune.training as tt
    from torchtune.models.llama2 import lora_llama2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training import set_default_dtype

    from ttparity import LORA_KWARGS, QLORA_KWARGS

    quantize, dtype, extra = VARIANTS[variant]
    if extra:
        with set_default_dtype(dtype), torch.device("meta"):
            model = lora_llama2(**{**(QLORA_KWARGS if quantize else LORA_KWARGS), **extra})
        set_trainable_params(model, get_adapter_params(model))
    else:
        model = lora_model("meta", quantize=quantize, dtype=dtype)
    if ac:  # torchtune's recipes wrap each layer in a CheckpointWrapper before sharding
        from torchtune.modules import TransformerSelfAttentionLayer

        tt.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    # the positional call torchtune's recipes make
    shard_fn(model, [tt.get_shard_conditions], cpu_offload=False, reshard_after_forward=reshard)
    return model


def _full_sd(variant: str) -> dict[str, torch.Tensor]:
    quantize, dtype, extra = VARIANTS[variant]
    if not extra:
        return random_full_state_dict(quantize, seed=1, dtype=dtype)
    ref = _build_cpu(variant)
    gen = torch.Generator().manual_seed(1)
    return {k: (torch.randn(v.shape, generator=gen) * 0.1).to(v.dtype)
            for k, v in ref.state_dict().items()}


def _build_cpu(variant: str):
    from torchtune.models.llama2 import lora_llama2
    from torchtune.training import set_default_dtype

    from ttparity import LORA_KWARGS

    _, dtype, extra = VARIANTS[variant]
    with set_default_dtype(dtype):
        return lora_llama2(**{**LORA_KWARGS, **extra})


def _loaded_pair(variant: str):
    """Both models sharded and loaded the way torchtune's LoRA recipe does it: adapters first,
    then the RoPE cache, then the base weights (``release_sd`` left at fsdptk's default)."""
    import torchtune.training as tt

    import fsdptk

    sd = _full_sd(variant)
    base, adapter = split(sd)
    pair, results = [], []
    for lib in (tt, fsdptk):
        model = _build(variant, lib.shard_model, ac=variant.endswith("+ac"))
        r1 = lib.load_from_full_model_state_dict(model, dict(adapter), CPU)
        rope_init(model)
        r2 = lib.load_from_full_model_state_dict(model, dict(base), CPU)
        for m in model.modules():
            if hasattr(m, "initialize_dora_magnitude"):
                m.initialize_dora_magnitude()
        pair.append(model)
        results.append((list(r1.missing_keys), list(r1.unexpected_keys),
                        list(r2.missing_keys), list(r2.unexpected_keys)))
    return pair, results, sd


def _load_and_gather(variant: str):
    import torchtune.training as tt

    import fsdptk

    (theirs, ours), results, sd = _loaded_pair(variant)
    rank0 = dist.get_rank() == 0
    if variant.endswith("+ac"):
        # the one difference: under activation checkpointing torchtune returns module-path keys
        # ("layers.0._checkpoint_wrapped_module.attn...."), fsdptk the state-dict keys
        clean = [[k.replace("_checkpoint_wrapped_module.", "") for k in keys] for keys in results[0]]
        returns = clean == list(results[1]) and results[0] != list(results[1])
    else:
        returns = list(results[0]) == list(results[1])
    out = {
        "returns": returns,
        "shards": diff_keys(theirs.state_dict(), ours.state_dict()),
        "buffers": diff_keys(dict(theirs.named_buffers()), dict(ours.named_buffers())),
        "facts": param_facts(theirs) == param_facts(ours),
    }
    for adapter_only in (False, True):
        g_t = tt.gather_cpu_state_dict(theirs, rank0, adapter_weights_only=adapter_only)
        g_o = fsdptk.gather_cpu_state_dict(ours, rank0, adapter_weights_only=adapter_only)
        out[f"gather adapter_only={adapter_only}"] = diff_keys(g_t, g_o)
        out[f"gather size adapter_only={adapter_only}"] = (len(g_o) > 0) == rank0
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    out["logits"] = same(theirs(tokens), ours(tokens))
    if not VARIANTS[variant][0]:  # the gathered state is the loaded one (NF4 is lossy)
        g = fsdptk.gather_cpu_state_dict(ours, rank0)
        out["round trip"] = diff_keys(g, sd) if rank0 else []
        if variant == "dora":  # magnitudes are recomputed from the base weight, not loaded
            out["round trip"] = [k for k in out["round trip"] if not k.endswith("magnitude")]
    return out


def _train(model, opt, steps: int, seed: int) -> list[torch.Tensor]:
    losses = []
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 8), generator=gen)
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def _steps_and_optimizer_round_trip(variant: str):
    import torchtune.training as tt

    import fsdptk

    (theirs, ours), _, _ = _loaded_pair(variant)
    rank0 = dist.get_rank() == 0
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
    opt_t, opt_o = make(theirs), make(ours)
    out = {"losses": same(_train(theirs, opt_t, 2, 0), _train(ours, opt_o, 2, 0))}
    out["shards after 2 AdamW steps"] = diff_keys(theirs.state_dict(), ours.state_dict())
    full_t = tt.get_full_optimizer_state_dict(theirs, opt_t, rank0)
    full_o = fsdptk.get_full_optimizer_state_dict(ours, opt_o, rank0)
    out["full optimizer state"] = same(full_t, full_o)
    out["full optimizer state on rank > 0 is {}"] = rank0 or (full_t == {} and full_o == {})
    # torchtune's loader needs the full state on every rank (its recipes load it from disk there)
    box = [full_t]
    dist.broadcast_object_list(box, src=0)
    full = box[0]
    new_t, new_o = make(theirs), make(ours)
    tt.load_from_full_optimizer_state_dict(theirs, new_t, copy.deepcopy(full), CPU)
    fsdptk.load_from_full_optimizer_state_dict(ours, new_o, copy.deepcopy(full), CPU)
    out["loaded optimizer state"] = same(new_t.state_dict(), new_o.state_dict())
    out["round trip"] = same(new_o.state_dict(), opt_o.state_dict())
    out["losses after resume"] = same(_train(theirs, new_t, 1, 1), _train(ours, new_o, 1, 1))
    out["shards after resume"] = diff_keys(theirs.state_dict(), ours.state_dict())
    return out


def _caller_dict_after_load(release_sd: bool | None):
    """What the caller's dict holds after each library's load (torchtune 0.6.1 has no
    ``release_sd``: it never touches the dict)."""
    import torchtune.training as tt

    import fsdptk

    sd = random_full_state_dict(seed=2)
    theirs, ours = _build("lora", tt.shard_model), _build("lora", fsdptk.shard_model)
    d_t, d_o = dict(sd), dict(sd)
    tt.load_from_full_model_state_dict(theirs, d_t, CPU)
    kwargs = {} if release_sd is None else {"release_sd": release_sd}
    fsdptk.load_from_full_model_state_dict(ours, d_o, CPU, **kwargs)
    return {
        "torchtune keeps every value": (list(d_t) == list(sd)
                                        and all(d_t[k] is v for k, v in sd.items())),
        "keys": list(d_o) == list(d_t),
        "truthy": bool(d_o) == bool(d_t),
        "values kept": all(d_o[k] is v for k, v in sd.items()),
        "values released": all(isinstance(d_o[k], torch.Tensor) and d_o[k].is_meta
                               and d_o[k].shape == v.shape and d_o[k].dtype == v.dtype
                               for k, v in sd.items()),
        "shards": diff_keys(theirs.state_dict(), ours.state_dict()),
    }


def _meta_errors(loaded: str):
    """Both libraries' meta-device check on a sharded model: nothing, the adapters, or
    everything loaded."""
    import torchtune.training as tt

    import fsdptk

    sd = random_full_state_dict(seed=3)
    base, adapter = split(sd)
    msgs = []
    for lib in (tt, fsdptk):
        model = _build("lora", lib.shard_model)
        if loaded in ("adapter", "all"):
            lib.load_from_full_model_state_dict(model, dict(adapter), CPU)
        if loaded == "all":
            rope_init(model)
            lib.load_from_full_model_state_dict(model, dict(base), CPU)
        try:
            lib.validate_no_params_on_meta_device(model)
            msgs.append(None)
        except RuntimeError as e:
            msgs.append(str(e))
    return msgs


def _sharding_layout(reshard: bool, ac: bool):
    """The units, placements and the parameters' state after forward and after backward (the
    root's ``reshard_after_forward`` included) of torchtune's and fsdptk's ``shard_model``."""
    import torchtune.training as tt
    from torch.distributed.fsdp import FSDPModule

    import fsdptk

    sd = random_full_state_dict(seed=4)
    facts = []
    for lib in (tt, fsdptk):
        model = _build("lora", lib.shard_model, reshard=reshard, ac=ac)
        units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        placements = {n: (tuple(p.placements), tuple(p.to_local().shape))
                      for n, p in model.named_parameters()}
        rope_init(model)
        tt.load_from_full_model_state_dict(model, dict(sd), CPU)  # the same loader for both
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        loss = model(tokens).pow(2).mean()
        after_fwd = {n: type(p).__name__ for n, p in model.named_parameters()}
        loss.backward()
        after_bwd = {n: type(p).__name__ for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        facts.append((units, placements, after_fwd, after_bwd, loss.detach(), grads))
    return [same(a, b) if i >= 4 else a == b for i, (a, b) in enumerate(zip(*facts))], facts[1][2]


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("n, variant", [(2, "lora"), (2, "dora"), (2, "qlora"), (2, "qlora+ac"),
                                        (4, "lora"), (4, "qlora")])
def test_load_and_gather_match_torchtune(world, n, variant):
    for rank, out in enumerate(world(n).run(_load_and_gather, variant)):
        bad = {k: v for k, v in out.items() if v not in (True, [])}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("n, variant", [(2, "lora"), (2, "qlora"), (4, "lora")])
def test_adamw_steps_and_optimizer_round_trip_match_torchtune(world, n, variant):
    for rank, out in enumerate(world(n).run(_steps_and_optimizer_round_trip, variant)):
        bad = {k: v for k, v in out.items() if v not in (True, [])}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("n", [2, 4])
def test_caller_dict_after_load_keeps_keys(world, n):
    """torchtune 0.6.1 leaves the dict untouched. fsdptk's default ``release_sd=True`` frees the
    memory and keeps the keys: each value becomes a ``meta`` tensor of the same shape and dtype
    (torchtune >= 0.7's ``release_sd`` sets ``None``), so the ``if sd:`` checks of torchtune's
    recipes still see a non-empty dict; ``release_sd=False`` is torchtune 0.6.1's behaviour."""
    for out in world(n).run(_caller_dict_after_load, None):
        assert out["torchtune keeps every value"] and out["keys"] and out["truthy"]
        assert out["values released"] and out["shards"] == []
    for out in world(n).run(_caller_dict_after_load, False):
        assert out["keys"] and out["values kept"] and out["shards"] == []


@pytest.mark.parametrize("loaded", ["nothing", "adapter", "all"])
def test_meta_device_check_matches_torchtune(world, loaded):
    for theirs, ours in world(2).run(_meta_errors, loaded):
        if loaded == "all":
            assert theirs is None and ours is None
        else:  # the same first tensor, torchtune's exact sentence, then our details
            assert theirs.startswith("Unexpected param or buffer ")
            assert ours.startswith(theirs), (theirs, ours)


@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("reshard", [True, False])
def test_shard_model_matches_torchtune(world, reshard, ac):
    """Same units and placements, and the same resharding after forward for every unit, the
    root included: under torch 2.13 an explicit ``reshard_after_forward`` (torchtune always
    passes one) also applies to the root, so the root's parameters are sharded again after
    forward when ``reshard=True``."""
    layer = "layers.0._checkpoint_wrapped_module" if ac else "layers.0"
    for checks, after_fwd in world(2).run(_sharding_layout, reshard, ac):
        assert checks == [True] * 6, checks
        expected = "DTensor" if reshard else "Parameter"
        assert after_fwd["tok_embeddings.weight"] == expected  # a root parameter
        assert after_fwd[f"{layer}.attn.q_proj.weight"] == expected  # a unit's parameter
