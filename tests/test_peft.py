"""PEFT adapters (LoRA, DoRA) under FSDP2 with the real peft and transformers (tiny configs, random
init, nothing downloaded), PEFT itself as the judge:

- meta build of base + ``get_peft_model`` -> ``shard_model(no_split_modules)`` at 2 and 4 ranks ->
  the plain base checkpoint loads with ``strict=True`` (no rename) -> ``load_adapter`` of an adapter
  PEFT's ``save_pretrained`` wrote -> logits and 3 AdamW steps equal the single-process PEFT model.
- ``gather_cpu_state_dict(adapter_weights_only=True)`` and ``save_adapter`` move only the adapter
  tensors (the engine's items recorded on every rank); the saved directory is what PEFT's own
  ``save_pretrained`` writes from the same weights unsharded (keys, tensors, adapter_config.json),
  and ``PeftModel.from_pretrained(base, dir)`` in one process gives the sharded model's logits.
- Resume: adapters (``load_adapter``) + optimizer (``load_from_full_optimizer_state_dict`` by FQN)
  after step 2 give step 3's loss of the run that never stopped.
- 2-D, (dp_shard=2, tp=2) on 4 ranks: ``hf_tp_plan`` of the PEFT model (base layers their base
  style, lora_B colwise beside a colwise base, lora_A rowwise beside a rowwise one) -> the same
  logits, 3 AdamW steps, save_adapter files and resume as the single-process PEFT model. DoRA and
  sequence parallel are refused by the plan.
- Bad input: no PEFT adapter, an unknown adapter name, an adapter of another rank: one error on
  every rank, nothing written, the model unchanged.

The module is skipped when peft is not importable (peft 0.21 needs torchao >= 0.16 beside it).
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

from fsdptk.predicates import no_split_modules

_LR, _STEPS = 1e-2, 3
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def _config(family: str):
    # vocab 250: uneven shards at 4 ranks
    return getattr(transformers, FAMILIES[family])(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=250, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)


def _lora(dora: bool, r: int = 4):
    # init_lora_weights=False: lora_B random too, so the adapter changes the logits from step 0
    return peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=_TARGETS, use_dora=dora,
                           init_lora_weights=False)


def _batch() -> torch.Tensor:
    return torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(7))


def _step(model, opt, batch) -> float:
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _adam(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=_LR)


_REFS: dict = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(family, dora) -> a base checkpoint (save_pretrained), an initial adapter (PEFT's
    save_pretrained), and the single-process PEFT model's logits and losses over 3 steps."""

    def get(family: str, dora: bool) -> dict:
        if (family, dora) not in _REFS:
            root = tmp_path_factory.mktemp(f"{family}-{'dora' if dora else 'lora'}")
            torch.manual_seed(0)
            base = transformers.AutoModelForCausalLM.from_config(_config(family))
            base.save_pretrained(root / "base")
            torch.manual_seed(1)
            model = peft.get_peft_model(base, _lora(dora))
            model.save_pretrained(root / "init")
            batch = _batch()
            with torch.no_grad():
                logits = model(input_ids=batch).logits
            opt = _adam(model)
            losses = [_step(model, opt, batch) for _ in range(_STEPS)]
            _REFS[family, dora] = {"root": root, "base": root / "base", "init": root / "init",
                                   "logits": logits, "losses": losses}
        return _REFS[family, dora]

    return get


def _meta_peft(family: str, dora: bool, r: int = 4):
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(_config(family))
    return peft.get_peft_model(base, _lora(dora, r))


def _record_collect():
    """Record the fqns every gather of the engine moves (on this rank)."""
    import fsdptk._engine as engine

    moved: list[list[str]] = []
    original = engine.collect

    def collect(items, *args, **kwargs):
        moved.append([fqn for fqn, _ in items])
        return original(items, *args, **kwargs)

    engine.collect = collect
    return moved, lambda: setattr(engine, "collect", original)


# ---------------------------------------------------------------------------------------------
# run on every rank
def _loop(family: str, dora: bool, mode: str, base: str, init: str, out: str, mid: str, ref_logits):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
        load_safetensors,
        shard_model,
        validate_no_params_on_meta_device,
    )
    from fsdptk.hf import load_adapter, save_adapter

    rank0 = dist.get_rank() == 0
    model = _meta_peft(family, dora)
    plan = shard_model(model, no_split_modules(model), cpu_offload=False)
    if mode == "broadcast":  # the base model's own state dict, on rank 0 only
        full_sd = load_file(f"{base}/model.safetensors") if rank0 else {}
        res = load_from_full_model_state_dict(model, full_sd, "cpu", strict=True,
                                              broadcast_from_rank0=True)
    else:  # the plain base checkpoint directory: no rename
        res = load_safetensors(model, base, strict=True)
    left = sorted(n for n, p in model.named_parameters() if p.is_meta)
    ares = load_adapter(model, init)
    validate_no_params_on_meta_device(model)
    batch = _batch()
    with torch.no_grad():
        diff = (model(input_ids=batch).logits - ref_logits).abs().max().item()
    opt = _adam(model)
    losses = [_step(model, opt, batch) for _ in range(_STEPS - 1)]
    osd = get_full_optimizer_state_dict(model, opt, rank0)
    save_adapter(model, mid)
    losses.append(_step(model, opt, batch))

    moved, restore = _record_collect()
    try:
        adapter_sd = gather_cpu_state_dict(model, rank0, adapter_weights_only=True)
        n_gathers = len(moved)
        saved = save_adapter(model, out)
    finally:
        restore()
    full = gather_cpu_state_dict(model, rank0)
    with torch.no_grad():
        trained_logits = model(input_ids=batch).logits

    # resume from `mid`: a new model, the base, the adapter, a new optimizer with the saved state
    model2 = _meta_peft(family, dora)
    shard_model(model2, no_split_modules(model2), cpu_offload=False)
    load_safetensors(model2, base, strict=True)
    load_adapter(model2, mid)
    opt2 = _adam(model2)
    load_from_full_optimizer_state_dict(model2, opt2, osd, "cpu", broadcast_from_rank0=True)
    resumed = _step(model2, opt2, batch)
    return {
        "units": [u.name for u in plan.units], "missing": list(res.missing_keys),
        "unexpected": list(res.unexpected_keys), "left_on_meta": left,
        "adapter_load": (list(ares.missing_keys), list(ares.unexpected_keys)),
        "logits_diff": diff, "losses": losses, "resumed": resumed,
        "adapter_sd": adapter_sd, "moved": moved, "n_gathers": n_gathers, "saved": str(saved),
        "full": full, "trained_logits": trained_logits,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }


# (family, DoRA, base load, world size)
CASES = [("llama", False, "safetensors", 2), ("llama", True, "safetensors", 4),
         ("qwen2", False, "broadcast", 4), ("qwen2", True, "broadcast", 2)]


@pytest.mark.parametrize("family, dora, mode, n", CASES, ids=[
    f"{f}-{'dora' if d else 'lora'}-{m}-{n}ranks" for f, d, m, n in CASES])
def test_lora_meta_shard_load_train_save_resume(world, reference, tmp_path, family, dora, mode, n):
    from safetensors import safe_open

    ref = reference(family, dora)
    out, mid = tmp_path / "adapter", tmp_path / "mid"
    results = world(n).run(_loop, family, dora, mode, str(ref["base"]), str(ref["init"]), str(out),
                           str(mid), ref["logits"])
    r0 = results[0]
    assert r0["units"] == ["base_model.model.model.layers.0", "base_model.model.model.layers.1",
                           "<root>"]
    trainable = r0["trainable"]
    assert trainable and all("lora_" in k for k in trainable)
    for r in results:
        # the base checkpoint loaded strictly; exactly the adapters were left for load_adapter
        assert r["missing"] == [] and r["unexpected"] == []
        assert r["left_on_meta"] == trainable
        assert r["adapter_load"] == ([], [])
        assert r["logits_diff"] <= 1e-5, f"logits differ from PEFT's by {r['logits_diff']}"
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=1e-5)
        # resume (adapters + optimizer by FQN) continues as if never stopped
        assert r["resumed"] == pytest.approx(r["losses"][-1], abs=1e-6)
        # only adapter tensors moved, on every rank: one gather for the dict, one for the save
        assert r["n_gathers"] == 1 and len(r["moved"]) == 2
        assert sorted(r["moved"][0]) == trainable
        assert len(r["moved"][1]) == len(trainable)
    assert sorted(r0["adapter_sd"]) == trainable
    assert all(r["adapter_sd"] == {} for r in results[1:])
    assert r0["saved"] == str(out / "adapter_model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    # PEFT's own save_pretrained of the same weights, unsharded
    base = transformers.AutoModelForCausalLM.from_pretrained(ref["base"])
    unsharded = peft.get_peft_model(base, _lora(dora))
    unsharded.load_state_dict(r0["full"], strict=True)
    unsharded.save_pretrained(tmp_path / "peft")
    with safe_open(out / "adapter_model.safetensors", "pt") as ours, \
            safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        assert ours.metadata() == theirs.metadata() == {"format": "pt"}
        for key in theirs.keys():  # noqa: SIM118 - a safe_open handle, not a dict
            a, b = ours.get_tensor(key), theirs.get_tensor(key)
            assert a.dtype == b.dtype and torch.equal(a, b), key
    ours, theirs = (json.loads((d / "adapter_config.json").read_text()) for d in (out, tmp_path / "peft"))
    for cfg in (ours, theirs):  # a set, written in hash order by PEFT
        cfg["target_modules"] = sorted(cfg["target_modules"])
    # the base's origin: PEFT records name_or_path, "" for a from_config model (as ours) -> None
    assert ours.pop("base_model_name_or_path") is None
    assert theirs.pop("base_model_name_or_path") == str(ref["base"])
    assert ours == theirs

    # PEFT loads the directory in one process and gives the sharded model's logits
    base = transformers.AutoModelForCausalLM.from_pretrained(ref["base"])
    loaded = peft.PeftModel.from_pretrained(base, out)
    with torch.no_grad():
        logits = loaded(input_ids=_batch()).logits
    assert (logits - r0["trained_logits"]).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------------------
# 2-D: (dp_shard=2, tp=2) on 4 ranks, hf_tp_plan translated for the LoRA layers
def _two_d_model(family: str):
    from fsdptk import ParallelDims, apply_tp, hf_tp_plan, shard_model

    dims = ParallelDims(dp_shard=2, tp=2)
    dims.build_mesh("cpu")
    model = _meta_peft(family, False)
    plan = hf_tp_plan(model)
    apply_tp(model, dims.tp_mesh, plan)
    shard_model(model, no_split_modules(model), cpu_offload=False, dp_mesh=dims.fsdp_mesh)
    return model, dims, plan


def _two_d_step(model, opt, batch, dims) -> float:
    import torch.distributed as dist

    per = batch.shape[0] // dims.dp_degree
    rows = batch[dims.dp_rank * per:(dims.dp_rank + 1) * per]  # this dp rank's share
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss, group=dims.fsdp_mesh.get_group())  # every row has as many tokens
    return loss.item() / dims.dp_degree


def _loop_two_d(family: str, base: str, init: str, out: str, mid: str, ref_logits):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        load_from_full_optimizer_state_dict,
        load_safetensors,
        validate_no_params_on_meta_device,
    )
    from fsdptk.hf import load_adapter, save_adapter

    rank0 = dist.get_rank() == 0
    model, dims, plan = _two_d_model(family)
    res = load_safetensors(model, base, strict=True)
    ares = load_adapter(model, init)
    validate_no_params_on_meta_device(model)
    layer = model.base_model.model.model.layers[0]
    placements = {name: (w.device_mesh.mesh_dim_names, tuple(w.to_local().shape)) for name, w in [
        ("q.base", layer.self_attn.q_proj.base_layer.weight),
        ("q.A", layer.self_attn.q_proj.lora_A["default"].weight),
        ("q.B", layer.self_attn.q_proj.lora_B["default"].weight),
        ("o.A", layer.self_attn.o_proj.lora_A["default"].weight),
        ("o.B", layer.self_attn.o_proj.lora_B["default"].weight)] if isinstance(w, DTensor)}
    batch = _batch()
    with torch.no_grad():
        diff = (model(input_ids=batch).logits - ref_logits).abs().max().item()
    opt = _adam(model)
    losses = [_two_d_step(model, opt, batch, dims) for _ in range(_STEPS - 1)]
    osd = get_full_optimizer_state_dict(model, opt, rank0)
    save_adapter(model, mid)
    losses.append(_two_d_step(model, opt, batch, dims))
    saved = save_adapter(model, out)
    full = gather_cpu_state_dict(model, rank0)
    with torch.no_grad():
        trained_logits = model(input_ids=batch).logits

    model2, dims2, _ = _two_d_model(family)
    load_safetensors(model2, base, strict=True)
    load_adapter(model2, mid)
    opt2 = _adam(model2)
    load_from_full_optimizer_state_dict(model2, opt2, osd, "cpu", broadcast_from_rank0=True)
    resumed = _two_d_step(model2, opt2, batch, dims2)
    return {
        "missing": list(res.missing_keys), "unexpected": list(res.unexpected_keys),
        "adapter_load": (list(ares.missing_keys), list(ares.unexpected_keys)),
        "plan": {k: type(v).__name__ for k, v in plan.items()}, "placements": placements,
        "logits_diff": diff, "losses": losses, "resumed": resumed, "saved": str(saved),
        "full": full if rank0 else {}, "trained_logits": trained_logits,
    }


def _compare_with_peft(out, peft_dir, full, ref, trained_logits, dora: bool = False) -> None:
    """The adapter directory ``out`` is what PEFT's save_pretrained writes from the same (gathered)
    weights, and PEFT's from_pretrained of it gives ``trained_logits``."""
    from safetensors import safe_open

    base = transformers.AutoModelForCausalLM.from_pretrained(ref["base"])
    unsharded = peft.get_peft_model(base, _lora(dora))
    unsharded.load_state_dict(full, strict=True)
    unsharded.save_pretrained(peft_dir)
    with safe_open(out / "adapter_model.safetensors", "pt") as ours, \
            safe_open(peft_dir / "adapter_model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        assert ours.metadata() == theirs.metadata() == {"format": "pt"}
        for key in theirs.keys():  # noqa: SIM118 - a safe_open handle, not a dict
            a, b = ours.get_tensor(key), theirs.get_tensor(key)
            assert a.dtype == b.dtype and torch.equal(a, b), key
    ours, theirs = (json.loads((d / "adapter_config.json").read_text()) for d in (out, peft_dir))
    for cfg in (ours, theirs):  # a set, written in hash order by PEFT
        cfg["target_modules"] = sorted(cfg["target_modules"])
    # the base's origin: PEFT records name_or_path, "" for a from_config model (as ours) -> None
    assert ours.pop("base_model_name_or_path") is None
    assert theirs.pop("base_model_name_or_path") == str(ref["base"])
    assert ours == theirs
    base = transformers.AutoModelForCausalLM.from_pretrained(ref["base"])
    loaded = peft.PeftModel.from_pretrained(base, out)
    with torch.no_grad():
        logits = loaded(input_ids=_batch()).logits
    assert (logits - trained_logits).abs().max().item() <= 1e-5


def test_lora_two_d_fsdp_x_tp_matches_single_process(world, reference, tmp_path):
    ref = reference("llama", False)
    out, mid = tmp_path / "adapter", tmp_path / "mid"
    results = world(4).run(_loop_two_d, "llama", str(ref["base"]), str(ref["init"]), str(out),
                           str(mid), ref["logits"])
    r0 = results[0]
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    o = "base_model.model.model.layers.0.self_attn.o_proj"
    assert r0["plan"][f"{q}.base_layer"] == "ColwiseKeepTied"
    assert r0["plan"][f"{q}.lora_B.default"] == "ColwiseParallel" and f"{q}.lora_A.default" not in r0["plan"]
    assert r0["plan"][f"{o}.base_layer"] == "RowwiseKeepTied"
    assert r0["plan"][f"{o}.lora_A.default"] == "RowwiseKeepTied" and f"{o}.lora_B.default" not in r0["plan"]
    # 2-D (dp, tp) DTensors where TP splits, dp-only shards where the adapter is whole per TP rank
    # (hidden 64, r 4): q's base and B split on their output features, o's A on its input ones
    dp, two_d = ("dp_shard",), ("dp_shard", "tp")
    assert r0["placements"] == {"q.base": (two_d, (16, 64)), "q.A": (dp, (2, 64)),
                                "q.B": (two_d, (16, 4)), "o.A": (two_d, (2, 32)), "o.B": (dp, (32, 4))}
    for r in results:
        assert r["missing"] == [] and r["unexpected"] == []
        assert r["adapter_load"] == ([], [])
        assert r["logits_diff"] <= 1e-5, f"logits differ from PEFT's by {r['logits_diff']}"
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=0, atol=1e-5)
        assert r["resumed"] == pytest.approx(r["losses"][-1], abs=1e-6)
    assert r0["saved"] == str(out / "adapter_model.safetensors")
    _compare_with_peft(out, tmp_path / "peft", r0["full"], ref, r0["trained_logits"])


def test_tp_plan_of_a_peft_model_refuses_what_it_cannot_split():
    from fsdptk import hf_tp_plan

    with pytest.raises(ValueError, match="LoRA variant"):
        hf_tp_plan(_meta_peft("llama", True))
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported on a PEFT model"):
        hf_tp_plan(_meta_peft("llama", False), sequence_parallel=True)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    plain = {k: repr(v) for k, v in hf_tp_plan(base).items()}
    # adapters only where asked: untargeted modules keep the base plan's own entry and name
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    plan = {k.removeprefix("base_model.model."): repr(v) for k, v in hf_tp_plan(model).items()}
    q = "model.layers.0.self_attn.q_proj"
    assert plan.pop(f"{q}.base_layer") == plain.pop(q)
    assert plan.pop(f"{q}.lora_B.default").startswith("ColwiseParallel(")
    plan.pop("model.layers.1.self_attn.q_proj.base_layer")
    plan.pop("model.layers.1.self_attn.q_proj.lora_B.default")
    plain.pop("model.layers.1.self_attn.q_proj")
    assert plan == plain


# ---------------------------------------------------------------------------------------------
# bad input: one error on every rank, nothing written or changed
def _bad_inputs(base: str, init: str, wrong_rank: str, out: str):
    import os

    from fsdptk import load_safetensors, shard_model
    from fsdptk.hf import load_adapter, save_adapter

    def outcome(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported to the test
            return type(e).__name__, str(e)
        return None

    with torch.device("meta"):
        plain = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    shard_model(plain, no_split_modules(plain), cpu_offload=False)
    load_safetensors(plain, base, strict=True)
    model = _meta_peft("llama", False)
    shard_model(model, no_split_modules(model), cpu_offload=False)
    load_safetensors(model, base, strict=True)
    load_adapter(model, init)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    errors = {
        "no_peft_save": outcome(lambda: save_adapter(plain, out)),
        "no_peft_load": outcome(lambda: load_adapter(plain, init)),
        "unknown_name_save": outcome(lambda: save_adapter(model, out, adapter_name="other")),
        "unknown_name_load": outcome(lambda: load_adapter(model, init, adapter_name="other")),
        "wrong_rank": outcome(lambda: load_adapter(model, wrong_rank)),
        "wrong_rank_lax": outcome(lambda: load_adapter(model, wrong_rank, strict=False)),
        "no_dir": outcome(lambda: load_adapter(model, base)),
    }
    unchanged = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    return errors, unchanged, os.path.exists(out)


def test_bad_input_is_one_error_on_every_rank(world, reference, tmp_path):
    ref = reference("llama", False)
    torch.manual_seed(0)
    other = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(ref["base"]),
                                _lora(False, r=8))
    other.save_pretrained(tmp_path / "r8")
    results = world(2).run(_bad_inputs, str(ref["base"]), str(ref["init"]), str(tmp_path / "r8"),
                           str(tmp_path / "out"))
    errors = results[0][0]
    for r in results:
        assert r[1] and not r[2]  # the model unchanged, nothing written
        assert {k: v[0] for k, v in r[0].items()} == {k: v[0] for k, v in errors.items()}
    assert errors["no_peft_save"][0] == "TypeError" and "has no PEFT adapter" in errors["no_peft_save"][1]
    assert errors["no_peft_load"][0] == "TypeError"
    for key in ("unknown_name_save", "unknown_name_load"):
        assert errors[key][0] == "KeyError" and "'other'" in errors[key][1] and "['default']" in errors[key][1]
    kind, msg = errors["wrong_rank"]
    assert kind == "ValueError" and "[8, 64] in the file, [4, 64] in the model" in msg
    assert "r: 8 in adapter_config.json, 4 in the model's adapter 'default'" in msg
    assert errors["wrong_rank_lax"][0] == "ValueError"  # shapes are never loaded
    assert errors["no_dir"][0] == "FileNotFoundError" and "adapter_model.safetensors" in errors["no_dir"][1]


# ---------------------------------------------------------------------------------------------
# single process
def test_base_key_map_follows_the_module_tree(reference):
    from fsdptk._plans.peft import base_names

    model = _meta_peft("qwen2", True)
    to_base, adapters = base_names(model)
    base_keys = set(transformers.AutoModelForCausalLM.from_config(_config("qwen2")).state_dict())
    assert set(to_base.values()) == base_keys
    assert to_base["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == \
        "model.layers.0.self_attn.q_proj.weight"
    assert to_base["base_model.model.lm_head.weight"] == "lm_head.weight"
    assert adapters == {k for k, p in model.named_parameters() if p.requires_grad}
    # tuners injected into the transformers model itself: no prefix, the same base names
    with torch.device("meta"):
        injected = transformers.AutoModelForCausalLM.from_config(_config("qwen2"))
    injected = peft.inject_adapter_in_model(_lora(False), injected)
    to_base, _ = base_names(injected)
    assert set(to_base.values()) == base_keys
    assert base_names(torch.nn.Linear(2, 2)) is None


def test_non_peft_models_keep_torchtunes_adapter_rule():
    from fsdptk import gather_cpu_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    assert sorted(gather_cpu_state_dict(model, True, adapter_weights_only=True)) == [
        "0.bias", "1.bias", "1.weight"]


def test_unsharded_round_trip_without_a_process_group(tmp_path):
    """save_adapter / load_adapter on a plain (unsharded) PEFT model, no process group."""
    from safetensors.torch import load_file

    from fsdptk.hf import load_adapter, save_adapter

    cfg = peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights=False)
    src = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), cfg)
    assert save_adapter(src, tmp_path / "ours") == tmp_path / "ours" / "adapter_model.safetensors"
    src.save_pretrained(tmp_path / "peft")
    ours, theirs = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "ours", tmp_path / "peft"))
    assert sorted(ours) == sorted(theirs) == ["base_model.model.0.lora_A.weight",
                                              "base_model.model.0.lora_B.weight"]
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    dst = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), cfg)
    assert str(load_adapter(dst, tmp_path / "ours")) == "<All keys matched successfully>"
    for name in ("lora_A", "lora_B"):
        assert torch.equal(getattr(dst.base_model.model[0], name)["default"].weight,
                           getattr(src.base_model.model[0], name)["default"].weight)
