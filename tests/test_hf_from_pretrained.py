"""fsdptk.hf.from_pretrained with the real transformers (tiny Llama / Qwen2 written with
save_pretrained in the test, nothing downloaded), on 2 gloo ranks (FSDP) and 4 (2 x 2 FSDP x TP,
2 x 2 HSDP):

- the logits equal a single-process unsharded model's, and those of transformers' own distributed
  load (``from_pretrained(path, distributed_config=DistributedConfig(...))``) on the same mesh
  (that path needs accelerate even on CPU: skipped where it is not installed);
- the model trains a step with an optimizer built after an eval forward (the whole batch's loss is
  the single-process loss, and every parameter is updated: none is left gathered by the forward), saves with
  save_safetensors, and from_pretrained loads the directory again with identical logits;
- rank 0 reads and sends when the other ranks do not see the directory; activation checkpointing
  recomputes each decoder layer and mixed precision gathers in bf16 over fp32 shards;
- the errors (no config.json, a TP size the heads do not divide, dims that do not match the world)
  are the same on every rank and come before any weight is read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fsdptk.hf import from_pretrained  # noqa: E402

_LR, _BATCH, _SEQ = 1e-3, 4, 8
_ATOL = 1e-5  # float32: sharded reductions round differently (measured up to ~2e-7)
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),  # tied embedding / lm_head
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),  # GQA, q/k/v biases
}
# (ranks, ParallelDims arguments (None: the default, FSDP over every rank), family)
LAYOUTS = [
    (2, None, "llama"),
    (2, None, "qwen2"),
    (4, {"dp_shard": 2, "tp": 2}, "llama"),
    (4, {"dp_shard": 2, "tp": 2}, "qwen2"),
    (4, {"dp_replicate": 2, "dp_shard": 2}, "llama"),
    (4, {"dp_replicate": 2, "dp_shard": 2}, "qwen2"),
]
_IDS = [f"{n}ranks-{'fsdp' if d is None else 'tp' if 'tp' in d else 'hsdp'}-{f}"
        for n, d, f in LAYOUTS]


def _config(family: str, **over):
    cls, extra = FAMILIES[family]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=250, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    return getattr(transformers, cls)(**{**kw, **extra, **over})


def _batch() -> torch.Tensor:
    return torch.randint(3, 250, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(7))


_REFS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> a save_pretrained directory, the unsharded model's logits on the batch and its
    loss on the whole batch (one process)."""

    def get(family: str) -> dict:
        if family not in _REFS:
            root = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(_config(family)).save_pretrained(root)
            model = transformers.AutoModelForCausalLM.from_pretrained(root)
            batch = _batch()
            with torch.no_grad():
                logits = model(input_ids=batch).logits
                loss = model(input_ids=batch, labels=batch).loss.item()
            _REFS[family] = {"src": root, "logits": logits, "loss": loss}
        return _REFS[family]

    return get


def _dims(dims_kw):
    from fsdptk import ParallelDims

    return None if dims_kw is None else ParallelDims(**dims_kw)


def _logits(model, batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch).logits
    return out.full_tensor() if hasattr(out, "full_tensor") else out


# ---------------------------------------------------------------------------------------------
# run on every rank
def _load_train_save_reload(src: str, dims_kw, out: str) -> dict:
    import torch.distributed as dist

    from fsdptk import save_safetensors

    dims = _dims(dims_kw)
    model = from_pretrained(src, dims=dims)
    w = model.model.layers[0].self_attn.q_proj.weight
    batch = _batch()
    loaded = _logits(model, batch)
    was_training = model.training

    model.train()
    dp_size = dist.get_world_size() if dims is None else dims.dp_degree
    dp_rank = dist.get_rank() if dims is None else dims.dp_rank
    per = _BATCH // dp_size
    rows = batch[dp_rank * per:(dp_rank + 1) * per]
    # built after an eval forward (``loaded``): every parameter must be the sharded one by then,
    # or a parameter still gathered from that forward gets no gradient and never trains
    opt = torch.optim.AdamW(model.parameters(), lr=_LR)
    def full(p):
        return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()

    before = {n: full(p).clone() for n, p in model.named_parameters()}
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    opt.step()
    untrained = sorted(n for n, p in model.named_parameters()
                       if p not in opt.state or torch.equal(full(p), before[n]))
    opt.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss)  # every rank's mean; TP ranks of one dp rank hold the same value
    whole_batch_loss = loss.item() / dist.get_world_size()

    model.eval()
    trained = _logits(model, batch)
    save_safetensors(model, out)
    again = from_pretrained(out, dims=_dims(dims_kw))
    reloaded = _logits(again, batch)
    hf = None
    if dist.get_rank() == 0:  # transformers' own single-process load of the saved directory
        plain, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        hf = {"missing": info["missing_keys"], "unexpected": info["unexpected_keys"],
              "diff": (_logits(plain, batch) - trained).abs().max().item()}
    return {"loaded": loaded, "was_training": was_training, "loss": whole_batch_loss,
            "trained": trained, "reloaded": reloaded, "hf": hf, "untrained": untrained,
            "q_proj": (w.device_mesh.mesh_dim_names, tuple(type(p).__name__ for p in w.placements)),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def _ours_and_transformers(src: str, dims_kw) -> dict:
    from transformers.distributed import DistributedConfig

    batch = _batch()
    ours = _logits(from_pretrained(src, dims=_dims(dims_kw)), batch)
    kw = dims_kw or {"dp_shard": torch.distributed.get_world_size()}
    config = DistributedConfig(fsdp_size=kw.get("dp_shard", 1), tp_size=kw.get("tp", 1),
                               dp_replicate_size=kw.get("dp_replicate", 1))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src, distributed_config=config)
    return {"ours": ours, "theirs": _logits(theirs, batch)}


def _ac_and_mixed_precision(src: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rows = _batch()[:2] if torch.distributed.get_rank() == 0 else _batch()[2:]
    out = {}
    for ac in (False, True):
        model = from_pretrained(src, mp_policy=policy, activation_checkpointing=ac).train()
        layer = model.model.layers[0]
        seen = {"calls": 0, "dtype": None}

        def count(module, args, seen=seen):
            seen["calls"] += 1
            seen["dtype"] = module.self_attn.q_proj.weight.dtype

        layer.register_forward_pre_hook(count)
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        grad = model.model.layers[1].mlp.down_proj.weight.grad.full_tensor()
        out[ac] = {"loss": loss.item(), "grad": grad, **seen,
                   "master": model.model.layers[0].self_attn.q_proj.weight.dtype}
    return out


def _error(src: str, dims_kw) -> tuple[str, str]:
    try:
        from_pretrained(src, dims=_dims(dims_kw))
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return type(e).__name__, str(e)
    return "no error", ""


def _per_rank_path(paths: list[str]) -> dict:
    import torch.distributed as dist

    model = from_pretrained(paths[dist.get_rank()])
    return {"logits": _logits(model, _batch()),
            "generation_config": model.generation_config.to_dict()}


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks, dims_kw, family", LAYOUTS, ids=_IDS)
def test_matches_single_process_trains_saves_and_reloads(world, reference, tmp_path, ranks,
                                                         dims_kw, family):
    ref = reference(family)
    results = world(ranks).run(_load_train_save_reload, str(ref["src"]), dims_kw,
                               str(tmp_path / "out"))
    tp = dims_kw is not None and "tp" in dims_kw
    for r in results:
        assert r["was_training"] is False  # eval mode, as transformers returns a loaded model
        diff = (r["loaded"] - ref["logits"]).abs().max().item()
        assert diff <= _ATOL, f"logits differ from the single-process model's by {diff}"
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert r["untrained"] == [], f"parameters the step did not update: {r['untrained']}"
        assert torch.equal(r["reloaded"], r["trained"])  # the saved directory, loaded again
        assert r["tied"] is (family == "llama")
        names = r["q_proj"][0]
        assert names == (("dp_shard", "tp") if tp else ("dp_replicate", "dp_shard")
                         if dims_kw else ("dp_shard",))
    assert all(torch.equal(r["trained"], results[0]["trained"]) for r in results)
    hf = results[0]["hf"]
    assert not hf["missing"] and not hf["unexpected"] and hf["diff"] <= _ATOL


@pytest.mark.parametrize("ranks, dims_kw, family", LAYOUTS, ids=_IDS)
def test_same_logits_as_transformers_distributed_config(world, reference, ranks, dims_kw,
                                                        family):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' distributed_config path needs accelerate (it sets a device_map)")
    ref = reference(family)
    for r in world(ranks).run(_ours_and_transformers, str(ref["src"]), dims_kw):
        ours_vs_theirs = (r["ours"] - r["theirs"]).abs().max().item()
        theirs_vs_ref = (r["theirs"] - ref["logits"]).abs().max().item()
        assert ours_vs_theirs <= _ATOL and theirs_vs_ref <= _ATOL, (ours_vs_theirs, theirs_vs_ref)


def test_rank0_reads_and_sends_when_other_ranks_do_not_see_the_directory(world, reference,
                                                                          tmp_path):
    ref = reference("llama")
    custom = tmp_path / "ckpt"  # a generation config of its own, which must reach every rank
    model = transformers.AutoModelForCausalLM.from_pretrained(ref["src"])
    model.generation_config.max_new_tokens = 17
    model.save_pretrained(custom)
    results = world(2).run(_per_rank_path, [str(custom), str(tmp_path / "not-on-this-host")])
    for r in results:
        assert (r["logits"] - ref["logits"]).abs().max().item() <= _ATOL
        assert r["generation_config"]["max_new_tokens"] == 17


def test_activation_checkpointing_and_mixed_precision(world, reference):
    for r in world(2).run(_ac_and_mixed_precision, str(reference("llama")["src"])):
        plain, checkpointed = r[False], r[True]
        assert plain["calls"] == 1 and checkpointed["calls"] == 2  # recomputed in backward
        assert plain["dtype"] == checkpointed["dtype"] == torch.bfloat16  # gathered in bf16
        assert plain["master"] == checkpointed["master"] == torch.float32  # sharded in fp32
        assert plain["loss"] == checkpointed["loss"]
        assert torch.equal(plain["grad"], checkpointed["grad"])


def _same_on_every_rank(results: list[tuple[str, str]], kind: str, pattern: str) -> None:
    import re

    first = results[0][1]
    assert re.search(pattern, first), first
    for rank, (name, message) in enumerate(results):
        assert name == kind, (rank, name, message)
        assert message.removesuffix(" (on rank 0)") == first, (rank, message)


def test_directory_without_config_is_one_error_on_every_rank(world, reference, tmp_path):
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes(
        (reference("llama")["src"] / "model.safetensors").read_bytes())
    _same_on_every_rank(world(2).run(_error, str(weights_only), None), "FileNotFoundError",
                        r"weights-only' has no config.json: not a Hugging Face checkpoint")


def test_tp_size_not_dividing_heads_is_one_error_before_any_weight_is_read(world, tmp_path):
    # config.json only: reading a weight would fail differently, so the error comes first
    _config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1
            ).save_pretrained(tmp_path)
    _same_on_every_rank(world(2).run(_error, str(tmp_path), {"tp": 2}), "ValueError",
                        r"Number of attention heads \(3\) must be divisible by tensor parallel "
                        r"size \(2\)")


def test_dims_not_matching_the_world_is_one_error_on_every_rank(world, reference):
    results = world(2).run(_error, str(reference("qwen2")["src"]),
                           {"dp_shard": 2, "tp": 2, "world_size": 4})
    _same_on_every_rank(results, "ValueError", r"the process group has 2 ranks but dims are for "
                                               r"world size 4 \(dp_replicate=1, dp_shard=2, tp=2\)")


def test_without_a_process_group_the_model_loads_whole(reference):
    ref = reference("qwen2")
    model = from_pretrained(Path(ref["src"]))
    assert not any(hasattr(p, "device_mesh") for p in model.parameters())
    assert (_logits(model, _batch()) - ref["logits"]).abs().max().item() == 0
    with pytest.raises(TypeError, match=r"dims must be a ParallelDims or None, got dict"):
        from_pretrained(ref["src"], dims={"tp": 2})


def test_the_collector_examines_only_what_the_call_makes_and_is_restored(reference, tmp_path):
    """Inside the call every automatic collection runs with what existed before it frozen; after
    it (on success and on error) nothing is left frozen and the collector is as it was; disabled
    by the caller, no collection runs inside; with objects the caller froze, the collector is
    paused instead and their freeze is left alone (one process: nothing sharded)."""
    import gc
    import sys

    src = str(reference("llama")["src"])
    runs: list[int] = []  # the freeze count at each collection inside the composition

    def count(phase, info):
        frame = sys._getframe()
        while phase == "start" and frame is not None:
            if frame.f_code.co_name == "_from_pretrained":
                runs.append(gc.get_freeze_count())
                return
            frame = frame.f_back

    thresholds = gc.get_threshold()
    gc.set_threshold(50, 5, 5)  # collections often enough for a tiny model's load (3.13's first is 2000)
    gc.callbacks.append(count)
    try:
        assert gc.get_freeze_count() == 0
        runs.clear()
        from_pretrained(src)
        assert runs and all(n > 0 for n in runs), runs  # collections ran, over the call's objects only
        assert gc.get_freeze_count() == 0 and gc.isenabled()
        runs.clear()
        with pytest.raises(FileNotFoundError):
            from_pretrained(str(tmp_path / "missing"))
        assert gc.get_freeze_count() == 0 and gc.isenabled()

        gc.disable()
        runs.clear()
        from_pretrained(src)
        assert runs == [] and not gc.isenabled() and gc.get_freeze_count() == 0
        gc.enable()

        # the caller's own frozen objects (a frozen object that dies by its reference count leaves
        # the permanent generation, so the count alone may drop: the sentinels say whether the
        # freeze was left alone, gc.get_objects() listing only the collectable generations)
        sentinels = [[i] for i in range(8)]
        gc.freeze()
        runs.clear()
        from_pretrained(src)
        assert runs == [] and gc.isenabled() and gc.get_freeze_count() > 0
        assert {id(s) for s in sentinels}.isdisjoint(id(o) for o in gc.get_objects())
        with pytest.raises(FileNotFoundError):
            from_pretrained(str(tmp_path / "missing"))
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert {id(s) for s in sentinels}.isdisjoint(id(o) for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
        gc.enable()


def test_cycles_made_inside_the_call_are_collected_inside_it():
    """The garbage the call's first-use imports leave (cycles) is freed while the call runs, not
    kept to its end (what pausing the collector did: more memory at the load's peak)."""
    import gc
    import weakref

    from fsdptk.hf.pretrained import _gc_quiet

    class Node:
        pass

    freed: list[int] = []
    with _gc_quiet():
        for i in range(5000):  # cycles, then enough allocations for the automatic collections
            a, b = Node(), Node()
            a.other, b.other = b, a
            weakref.finalize(a, freed.append, i)
            del a, b
        _ = [[j] for j in range(20000)]
        inside = len(freed)
    assert inside > 0, "no cycle made inside the block was collected inside it"
    assert gc.get_freeze_count() == 0 and gc.isenabled()


@pytest.mark.parametrize("age", ["young", "old"])
def test_garbage_made_before_the_block_is_freed_not_frozen(age):
    """A cycle dropped just before the block (young, or old: it survived a full collection) is
    freed by the time the block's body runs, not frozen with the live objects and then left in the
    oldest generation after it."""
    import gc
    import weakref

    from fsdptk.hf.pretrained import _gc_quiet

    class Node:
        pass

    freed: list[str] = []
    a, b = Node(), Node()
    a.other, b.other = b, a
    weakref.finalize(a, freed.append, age)
    if age == "old":
        gc.collect()  # it survives a full collection: now in the oldest generation
    del a, b
    with _gc_quiet():
        inside = list(freed)
        _ = [[j] for j in range(20000)]  # young collections inside the block
    assert inside == [age]
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_reload_loop_never_holds_the_dropped_model(reference):
    """``del model; model = from_pretrained(src)`` in a loop: the dropped model (cycles, in the
    oldest generation after the call that made it) is freed before the reload returns, so the loop
    never holds two models."""
    import gc
    import weakref

    src = str(reference("llama")["src"])
    drops: list[weakref.ref] = []
    for _ in range(3):
        model = from_pretrained(src)
        object.__setattr__(model, "_cycle", [model])  # a cycle: only the collector frees it
        gc.collect()  # it survived a full collection: the oldest generation
        drops.append(weakref.ref(model))
        del model
        from_pretrained(src)
        assert drops[-1]() is None, "the dropped model outlived the reload"
