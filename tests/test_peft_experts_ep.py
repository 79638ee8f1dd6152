"""LoRA on the fused MoE experts (PEFT 0.21's ``target_parameters``) under expert parallelism (issue
43, item 3's EP part), PEFT and transformers single-process as the judge.

Qwen3-MoE at 2 ranks (``dp_shard=2, ep=2``: each rank 4 of the 8 experts, efsdp 1), Mixtral at 4
(``dp_shard=4, ep=2``: 4 experts per rank, FSDP-sharded over efsdp 2) and HSDP x EP, Qwen3-MoE at 4
(``dp_replicate=2, dp_shard=2, ep=2``: the experts and their factors replicated over the two
replicas), tiny configs written by
``save_pretrained``: meta build -> ``get_peft_model`` (LoRA on ``q_proj`` and on
``mlp.experts.gate_up_proj`` / ``down_proj``) -> ``hf_ep_plan`` -> ``apply_ep`` -> ``shard_model`` ->
Hub-layout base load -> ``load_adapter`` of the adapter PEFT saved in one process ->

- each rank holds only its experts' LoRA blocks: the local numel of every experts factor is its
  full numel / (ep * efsdp), and its ``ep`` block equals PEFT's rows ``[k*L*r, (k+1)*L*r)`` of A and
  PEFT's strided columns of B for the experts ``[k*L, (k+1)*L)`` of ep rank ``k``;
- logits equal PEFT's; one SGD step (momentum 0.9: the first step is plain SGD and the optimizer
  state is the gradient) on each rank's own rows: each rank's loss is PEFT's on those rows; the
  whole-batch loss, the adapters after the step and the optimizer state by FQN (the momentum
  buffers, i.e. the gradients) equal PEFT's after a step on the whole batch;
- ``save_adapter`` writes what PEFT's ``save_pretrained`` writes from the same weights (keys, tensors
  bit for bit, adapter_config.json); ``PeftModel.from_pretrained`` of it gives the trained logits;
  a new EP model that loads the base, ``load_adapter`` and the optimizer state resumes exactly
  (logits, and each rank's local optimizer state);
- a bad experts adapter (another expert count, another ``r``) is one ValueError on every rank
  naming the key and both shapes, the adapters left on ``meta``;
- what is still not built is refused by name: EP x TP with LoRA on the experts, one expert per
  rank, and PEFT wrapping an experts module after ``apply_ep``;
- DCP across EP degrees from a background save (Qwen3-MoE, 4 ranks): one step at ``ep=2``,
  ``save_dcp_async``, a second step while it writes, ``load_dcp`` into the model built at ``ep=4``
  and at ``ep=1`` (FSDP only): adapters (gathered), optimizer state by FQN and logits are PEFT's
  after one whole-batch step; the checkpoint holds each experts B factor as PEFT's B reshaped to
  ``(out, r, E)``; a checkpoint holding B 2-D is refused by name at ``ep=4``;
- fresh adapters: ``init_adapters`` at ``ep=2``, every rank seeded differently, gives PEFT's own
  initialisation from the seed (bit for bit) and PEFT's adapters after one step.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_hf_moe import build_reference  # noqa: E402 - after the skips
from tests.test_peft_experts import _EXPERTS, _batch, _lora, assert_peft_saves_the_same, step_on_rows  # noqa: E402

_LR = 0.5
# case -> (family, world size, ParallelDims kwargs)
CASES = {"qwen3_moe": ("qwen3_moe", 2, {"dp_shard": 2, "ep": 2}),
         "mixtral": ("mixtral", 4, {"dp_shard": 4, "ep": 2}),
         # HSDP x EP: 2 replicas of (dp_shard 2 = ep 2, efsdp 1), the experts replicated over dp_replicate
         "qwen3_moe_hsdp": ("qwen3_moe", 4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2})}


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=_LR, momentum=0.9)


def _judge(src: str, tmp_path_factory, family: str, world_size: int) -> dict:
    """PEFT in one process: the adapter it saves, logits, per-rank-rows losses, one whole-batch
    SGD step (adapters, gradients, loss, trained logits)."""
    torch.manual_seed(3)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(src), _lora())
    init = tmp_path_factory.mktemp(f"{family}_ep_adapter")
    model.save_pretrained(init)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "lora_" in n}
    batch = _batch()
    with torch.no_grad():
        logits = model(input_ids=batch).logits
        rows = [model(input_ids=b, labels=b).loss.item() for b in batch.chunk(world_size)]
    opt = _sgd(model)
    model(input_ids=batch, labels=batch).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    with torch.no_grad():
        whole = model(input_ids=batch, labels=batch).loss.item()
        trained = model(input_ids=batch).logits
    return {"init": str(init), "logits": logits, "rows": rows, "whole": whole, "trained": trained,
            "grads": grads, "start": start, "num_experts": model.base_model.model.config.num_experts
            if hasattr(model.base_model.model.config, "num_experts")
            else model.base_model.model.config.num_local_experts,
            "adapters": {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}}


def _ep_model(src: str, dims: dict, lora=None):
    """On every rank: meta build -> get_peft_model -> hf_ep_plan -> apply_ep -> shard_model -> base
    (``ep`` 1: no apply_ep, the experts FSDP-sharded with the rest)."""
    from fsdptk import ParallelDims, apply_ep, load_safetensors, shard_model
    from fsdptk.hf import hf_ep_plan, no_split_modules

    config = transformers.AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(base, lora or _lora())
    pd = ParallelDims(**dims)
    pd.build_mesh("cpu")
    experts = hf_ep_plan(model) if pd.ep > 1 else []  # ep=1: FSDP (or HSDP) only
    if experts:
        apply_ep(model, pd.ep_mesh, experts)
    shard_model(model, no_split_modules(model), cpu_offload=False, dp_mesh=pd.fsdp_mesh,
                expert_dp_mesh=pd.expert_fsdp_mesh if experts else None)
    res = load_safetensors(model, src, strict=True)
    return model, pd, experts, (res.missing_keys, res.unexpected_keys)


def _factors(model) -> dict:
    return {n: p for n, p in model.named_parameters() if "experts" in n and "lora_" in n}


def _ep_blocks(model) -> dict:
    """Each experts factor's block on this rank's ep coordinate (its efsdp shards gathered by torch)."""
    from torch.distributed.tensor import Replicate

    out = {}
    for n, p in _factors(model).items():
        placements = [Replicate()] * (p.device_mesh.ndim - 1) + [p.placements[-1]]
        out[n] = p.redistribute(p.device_mesh, placements).to_local().detach().clone()
    return out


def _ep_placement(p) -> tuple:
    """(class name, dim, split factor) of a DTensor's placement on its last (``ep``) mesh dim."""
    last = p.placements[-1]
    return type(last).__name__, last.dim, getattr(last, "split_factor", None)


def _train(src: str, init: str, out: str, dims: dict) -> dict:
    """On every rank: the composition, one SGD step on this rank's rows, save_adapter, resume."""
    import torch.distributed as dist

    from fsdptk import gather_cpu_state_dict, get_full_optimizer_state_dict, load_from_full_optimizer_state_dict
    from fsdptk.hf import load_adapter, save_adapter

    rank, world = dist.get_rank(), dist.get_world_size()
    from _counting import file_reads

    model, pd, experts, keys = _ep_model(src, dims)
    with file_reads() as reads:
        ares = load_adapter(model, init)
    factors = _factors(model)
    read = {}  # the experts factors' bytes this rank read from the adapter file, by model fqn
    for key, _, nbytes in reads:
        fqn = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
        if fqn in factors:
            read[fqn] = read.get(fqn, 0) + nbytes
    memory = {n: (p.numel(), p.to_local().numel(), _ep_placement(p), list(p.device_mesh.mesh_dim_names),
                  read.get(n, 0) // p.element_size()) for n, p in factors.items()}
    blocks = _ep_blocks(model)
    batch = _batch()
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    rows = batch.chunk(world)[rank]
    opt, loss, whole, trained = step_on_rows(model, rows, batch, _sgd(model))
    adapters = gather_cpu_state_dict(model, rank == 0, adapter_weights_only=True)
    osd = get_full_optimizer_state_dict(model, opt, rank == 0)
    save_adapter(model, out)
    local_state = {n: opt.state[p]["momentum_buffer"].to_local().clone() for n, p in factors.items()}
    # resume: a new EP model, the base, the saved adapter and the optimizer state
    again, _, _, _ = _ep_model(src, dims)
    load_adapter(again, out)
    opt2 = _sgd(again)
    load_from_full_optimizer_state_dict(again, opt2, osd if rank == 0 else {}, "cpu", broadcast_from_rank0=True)
    with torch.no_grad():
        resumed = again(input_ids=batch).logits
    resumed_state = {n: opt2.state[p]["momentum_buffer"].to_local() for n, p in _factors(again).items()}
    return {"experts": experts, "keys": keys + (ares.missing_keys, ares.unexpected_keys),
            "ep_rank": pd.ep_mesh.get_local_rank(), "memory": memory, "blocks": blocks,
            "logits": logits, "loss": loss, "whole": whole, "trained": trained,
            "adapters": adapters, "osd": osd, "resumed": resumed,
            "state_equal": all(torch.equal(local_state[n], resumed_state[n]) for n in local_state)}


def _peft_blocks(full: torch.Tensor, name: str, experts: int, ep: int, k: int) -> torch.Tensor:
    """PEFT's own layout read by hand: the A rows / B columns of the experts of ep rank ``k``."""
    local = experts // ep
    if ".lora_A." in name:  # (r * E, in) read as (E, r, in)
        return full.reshape(experts, -1, full.shape[-1])[k * local:(k + 1) * local].reshape(-1, full.shape[-1])
    # (out, r * E) read as (out, r, E)
    return full.reshape(full.shape[0], -1, experts)[:, :, k * local:(k + 1) * local].reshape(full.shape[0], -1)


@pytest.mark.parametrize("case", list(CASES))
def test_lora_on_the_experts_under_ep_loads_trains_and_saves_as_peft(world, tmp_path_factory, case) -> None:
    family, n, dims = CASES[case]
    ep = dims["ep"]
    efsdp = dims["dp_shard"] // ep
    mesh_dims = (["dp_replicate"] if dims.get("dp_replicate", 1) > 1 else []) + ["efsdp", "ep"]
    src = str(build_reference(tmp_path_factory, family)["src"])
    judge = _judge(src, tmp_path_factory, family, n)
    experts = judge["num_experts"]
    out = tmp_path_factory.mktemp(f"{case}_ep_ours")
    results = world(n).run(_train, src, judge["init"], str(out), dims, timeout=300)
    for rank, r in enumerate(results):
        assert r["experts"] == [f"base_model.model.model.layers.{i}.mlp.experts.base_layer.base_layer"
                                for i in range(2)], r["experts"]
        assert r["keys"] == ([], [], [], []), (rank, r["keys"])
        # memory: this rank holds 1 / (ep * efsdp) of every experts factor, its experts' blocks only
        assert len(r["memory"]) == 8, r["memory"]  # 2 layers x 2 wrappers x (A, B)
        for name, (full, local, placement, mesh, read) in r["memory"].items():
            assert mesh == mesh_dims and local * ep * efsdp == full, (rank, name, full, local, mesh)
            assert read == local, (rank, name, full, local, read)  # load_adapter read only its blocks
            assert placement == (("Shard", 0, None) if ".lora_A." in name else ("_StridedShard", 1, 4)), (
                name, placement)
            want = _peft_blocks(judge["start"][name], name, experts, ep, r["ep_rank"])
            assert torch.equal(r["blocks"][name], want), (rank, name)
        torch.testing.assert_close(r["logits"], judge["logits"], rtol=1e-5, atol=1e-5)
        assert abs(r["loss"] - judge["rows"][rank]) < 1e-5, (rank, r["loss"], judge["rows"][rank])
        assert abs(r["whole"] - judge["whole"]) < 1e-5, (rank, r["whole"], judge["whole"])
        torch.testing.assert_close(r["resumed"], r["trained"], rtol=0, atol=0)
        assert r["state_equal"], rank
    ours = results[0]["adapters"]
    assert all(r["adapters"] == {} and r["osd"] == {} for r in results[1:])
    assert sorted(ours) == sorted(judge["adapters"])
    for k, want in judge["adapters"].items():
        torch.testing.assert_close(ours[k], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    # the optimizer state by FQN: each momentum buffer is the gradient of PEFT's whole-batch step
    state = results[0]["osd"]["state"]
    assert sorted(state) == sorted(judge["grads"])
    for k, g in judge["grads"].items():
        torch.testing.assert_close(state[k]["momentum_buffer"], g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")

    # PEFT's own save of the same (gathered) weights: the same files, bit for bit
    assert_peft_saves_the_same(out, src, ours, _lora(), tmp_path_factory.mktemp(f"{case}_ep_peft_save"), base=False)
    assert sorted(json.loads((out / "adapter_config.json").read_text())["target_parameters"]) == sorted(_EXPERTS)

    # PEFT loads our directory in one process and gives the EP model's trained logits
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(src), out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=_batch()).logits, results[0]["trained"],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(input_ids=_batch()).logits, judge["trained"],
                                   rtol=1e-4, atol=1e-5)


def _bad_adapter(src: str, bad: str) -> tuple[str, str, bool]:
    """On every rank: the EP composition up to load_adapter of a bad experts adapter."""
    from fsdptk.hf import load_adapter

    model, _, _, _ = _ep_model(src, {"dp_shard": 2, "ep": 2})
    try:
        load_adapter(model, bad)
    except (ValueError, KeyError) as e:
        untouched = all(p.to_local().is_meta for n, p in model.named_parameters() if "lora_" in n)
        return type(e).__name__, str(e), untouched
    return "", "", False


@pytest.mark.parametrize("case", ["other_expert_count", "other_rank"])
def test_a_bad_experts_adapter_under_ep_is_named_on_every_rank_before_the_model_changes(
        world, tmp_path_factory, case) -> None:
    from safetensors.torch import load_file, save_file

    src = str(build_reference(tmp_path_factory, "qwen3_moe")["src"])
    torch.manual_seed(3)
    r = 8 if case == "other_rank" else 4
    lora = peft.LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj"], target_parameters=_EXPERTS,
                           init_lora_weights=False)
    bad = tmp_path_factory.mktemp(f"ep_bad_{case}")
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(src), lora).save_pretrained(bad)
    prefix = "base_model.model.model.layers.1.mlp.experts.base_layer"  # gate_up: A (r*E, H), B (2I, r*E)
    if case == "other_expert_count":  # the layout PEFT gives an experts module of 4 experts, not 8
        tensors = load_file(bad / "adapter_model.safetensors")
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        tensors[f"{prefix}.lora_A.weight"] = a.reshape(8, 4, -1)[:4].reshape(16, -1).contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.reshape(b.shape[0], 4, 8)[:, :, :4].reshape(b.shape[0], 16).contiguous()
        save_file(tensors, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    results = world(2).run(_bad_adapter, src, str(bad), timeout=180)
    for rank, (kind, msg, untouched) in enumerate(results):
        assert kind == "ValueError" and untouched, (rank, kind, msg)
        if case == "other_expert_count":
            assert f"'{prefix}.lora_A.weight': shape [16, 64] in the file, [32, 64] in the model" in msg, msg
        else:
            assert "shape [64, 64] in the file, [32, 64] in the model" in msg, msg
            assert "r: 8 in adapter_config.json, 4 in the model's adapter 'default'" in msg, msg
    assert len({m.removesuffix(" (on rank 0)") for _, m, _ in results}) == 1


def _not_built(case: str) -> tuple[str, str, bool]:
    """On every rank: apply_ep where LoRA on the experts is still not built; is anything sharded?"""
    from torch.distributed.tensor import DTensor

    from fsdptk import ParallelDims, apply_ep
    from fsdptk.hf import hf_ep_plan

    experts = 2 if case == "one_expert_per_rank" else 4
    config = transformers.Qwen3MoeConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, head_dim=16, vocab_size=64,
                                         num_experts=experts, num_experts_per_tok=1,
                                         moe_intermediate_size=8, intermediate_size=32)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config), _lora())
    dims = ParallelDims(dp_shard=1, tp=2, ep=2) if case == "ep_x_tp" else ParallelDims(dp_shard=2, ep=2)
    dims.build_mesh("cpu")
    try:
        apply_ep(model, dims.ep_mesh, hf_ep_plan(model), tp_mesh=dims.tp_mesh if case == "ep_x_tp" else None)
    except NotImplementedError as e:
        return type(e).__name__, str(e), any(isinstance(p, DTensor) for p in model.parameters())
    return "", "", True


@pytest.mark.parametrize("case", ["ep_x_tp", "one_expert_per_rank"])
def test_what_is_not_built_is_refused_by_name_before_anything_changes(world, case) -> None:
    for rank, (kind, msg, changed) in enumerate(world(2).run(_not_built, case, timeout=120)):
        assert kind == "NotImplementedError" and not changed, (rank, kind, msg)
        if case == "ep_x_tp":
            assert "LoRA on the experts under expert parallelism with tensor parallelism (tp_mesh) is not built" in msg
            assert "ParamWrapper 'base_model.model.model.layers.0.mlp.experts'" in msg, msg
        else:
            assert "needs at least 2 experts per rank: ep (2) leaves 1 of the 2 experts" in msg, msg


# ----------------------------------------------------------------------------------------------
# DCP across EP degrees, written in the background (issue 43 item 3: "background save, DCP across EP
# degrees"). torch 2.13's DCP cannot place B's strided expert blocks (it plans one box per rank:
# "overlapping chunks"); fsdptk hands DCP the (out, r, E) view of every experts B factor.
_DCP_FROM = {"dp_shard": 4, "ep": 2}
_DCP_TO = {"ep4": {"dp_shard": 4, "ep": 4}, "ep1": {"dp_shard": 4}}


def _dcp_across(src: str, init: str, ck: str, old: str) -> dict:
    """On every rank: one step at ep=2, save_dcp_async, a second step while it writes; load_dcp into
    the model built at ep=4 and at ep=1; a checkpoint holding B 2-D (torch's own dcp.save of the ep=1
    model) loaded at ep=4."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fsdptk import gather_cpu_state_dict, get_full_optimizer_state_dict, load_dcp, save_dcp_async
    from fsdptk.hf import load_adapter

    rank = dist.get_rank()
    batch = _batch()
    rows = batch.chunk(dist.get_world_size())[rank]
    model, _, _, _ = _ep_model(src, _DCP_FROM)
    load_adapter(model, init)
    opt = _sgd(model)
    model(input_ids=rows, labels=rows).loss.backward()
    opt.step()
    opt.zero_grad()
    saved = gather_cpu_state_dict(model, rank == 0, adapter_weights_only=True)
    pending = save_dcp_async(model, ck, opt, extra={"step": 1})
    model(input_ids=rows, labels=rows).loss.backward()  # the snapshot is taken: a second step
    opt.step()
    pending.wait()
    out: dict = {"saved": saved}
    for name, dims in _DCP_TO.items():
        again, _, _, _ = _ep_model(src, dims)
        load_adapter(again, init)  # values to be overwritten: the adapters off meta
        opt2 = _sgd(again)
        extra = load_dcp(again, ck, opt2)
        with torch.no_grad():
            logits = again(input_ids=batch).logits
        out[name] = {"extra": extra, "logits": logits,
                     "adapters": gather_cpu_state_dict(again, rank == 0, adapter_weights_only=True),
                     "osd": get_full_optimizer_state_dict(again, opt2, rank == 0)}
        out[name]["model"] = again
    # a checkpoint with B (out, r * E) 2-D, as torch's dcp.save writes the ep=1 model: refused at ep=4
    dcp.save({"model": get_model_state_dict(out["ep1"].pop("model"))}, checkpoint_id=old)
    ep4 = out["ep4"].pop("model")
    try:
        load_dcp(ep4, old)
        out["old"] = ("", "")
    except ValueError as e:
        out["old"] = (type(e).__name__, str(e))
    with torch.no_grad():
        out["unchanged"] = torch.equal(ep4(input_ids=batch).logits, out["ep4"]["logits"])
    return out


def test_dcp_across_ep_degrees_from_a_background_save_gives_pefts_step(world, tmp_path_factory) -> None:
    from safetensors.torch import load_file

    from fsdptk import dcp_to_safetensors

    src = str(build_reference(tmp_path_factory, "qwen3_moe")["src"])
    judge = _judge(src, tmp_path_factory, "qwen3_moe", 4)
    root = tmp_path_factory.mktemp("ep_dcp")
    results = world(4).run(_dcp_across, src, judge["init"], str(root / "step_1"), str(root / "old"),
                           timeout=300)
    saved = results[0]["saved"]
    b_keys = [k for k in judge["adapters"] if ".experts" in k and ".lora_B." in k]
    assert len(b_keys) == 4, b_keys
    for name in _DCP_TO:
        for rank, r in enumerate(results):
            assert r[name]["extra"] == {"step": 1}, (name, rank)
            # the step saved, not the second one taken while the save ran: PEFT's logits after one step
            torch.testing.assert_close(r[name]["logits"], judge["trained"], rtol=1e-4, atol=1e-5)
        ours, osd = results[0][name]["adapters"], results[0][name]["osd"]["state"]
        assert sorted(ours) == sorted(judge["adapters"]) == sorted(saved)
        for k, want in judge["adapters"].items():
            assert torch.equal(ours[k], saved[k]), (name, k)  # what ep=2 held, bit for bit
            torch.testing.assert_close(ours[k], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        assert sorted(osd) == sorted(judge["grads"])
        for k, g in judge["grads"].items():  # momentum after one step: PEFT's whole-batch gradient
            torch.testing.assert_close(osd[k]["momentum_buffer"], g, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=k, name=name: f"{name} {k}: {m}")
    # the checkpoint holds each experts B factor as (out, r, E): PEFT's B reshaped, nothing else
    files = load_file(dcp_to_safetensors(root / "step_1", root / "as_safetensors"))
    for k in b_keys:
        b = saved[k]
        assert torch.equal(files[k], b.reshape(b.shape[0], 4, -1)), k
    a = next(k for k in judge["adapters"] if ".experts" in k and ".lora_A." in k)
    assert torch.equal(files[a], saved[a]), a
    for rank, r in enumerate(results):
        kind, msg = r["old"]
        assert kind == "ValueError" and r["unchanged"], (rank, kind, msg)
        assert "LoRA factor 'base_model.model.model.layers.0.mlp.experts.lora_B.default.weight' " \
               "is held (out, r * E) = [64, 32] in the checkpoint" in msg, msg
        assert "_StridedShard(dim=1" in msg and "load it into a model without expert parallelism" in msg, msg


# ----------------------------------------------------------------------------------------------
# Fresh adapters under EP (issue 43 item 2 with item 3's EP): init_adapters on the EP model gives
# PEFT's own initialisation from the seed, every rank's seed and RNG state notwithstanding.
_FRESH_SEED = 5


def _fresh_lora():
    # init_lora_weights=False: A and B both random (PEFT's init_lora_weights=False draw), so B's
    # strided expert blocks carry values from the start
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=_EXPERTS,
                           init_lora_weights=False)


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _fresh_ep(src: str, dims: dict) -> dict:
    """On every rank: the EP composition, init_adapters with every rank's generator seeded
    differently, one SGD step on this rank's rows."""
    import torch.distributed as dist

    from fsdptk.hf import init_adapters

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _, _, _ = _ep_model(src, dims, _fresh_lora())
    torch.manual_seed(1000 + rank)  # a rank whose seed differs makes no difference
    keys = init_adapters(model, seed=_FRESH_SEED)
    attached = _full(model)
    placements = {n: _ep_placement(p) for n, p in _factors(model).items()}
    batch = _batch()
    rows = batch.chunk(world)[rank]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=_LR)
    model(input_ids=rows, labels=rows).loss.backward()
    opt.step()
    with torch.no_grad():
        whole = model(input_ids=batch, labels=batch).loss.item()
    return {"keys": keys, "attached": attached, "placements": placements, "stepped": _full(model),
            "whole": whole}


def test_fresh_adapters_under_ep_are_pefts_init_on_every_rank_before_and_after_a_step(
        world, tmp_path_factory) -> None:
    src = str(build_reference(tmp_path_factory, "qwen3_moe")["src"])
    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    torch.manual_seed(_FRESH_SEED)
    judge = peft.get_peft_model(base, _fresh_lora())
    attached = {n: p.detach().clone() for n, p in judge.named_parameters() if "lora_" in n}
    batch = _batch()
    opt = torch.optim.SGD([p for p in judge.parameters() if p.requires_grad], lr=_LR)
    judge(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    with torch.no_grad():
        whole = judge(input_ids=batch, labels=batch).loss.item()
    stepped = {n: p.detach().clone() for n, p in judge.named_parameters() if "lora_" in n}
    results = world(2).run(_fresh_ep, src, {"dp_shard": 2, "ep": 2}, timeout=180)
    for rank, r in enumerate(results):
        assert sorted(r["keys"]) == sorted(attached), rank
        assert len(r["placements"]) == 8 and all(
            pl == (("Shard", 0, None) if ".lora_A." in n else ("_StridedShard", 1, 4))
            for n, pl in r["placements"].items()), r["placements"]
        for k, want in attached.items():
            assert torch.equal(r["attached"][k], want), (rank, k)  # PEFT's init, bit for bit
            torch.testing.assert_close(r["stepped"][k], stepped[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, rank=rank: f"rank {rank} {k}: {m}")
            assert torch.equal(r["stepped"][k], results[0]["stepped"][k]), (rank, k)
        assert abs(r["whole"] - whole) < 1e-5, (rank, r["whole"], whole)
    moved = [k for k, v in stepped.items() if not torch.equal(v, attached[k])]
    assert any(".experts" in k and ".lora_B." in k for k in moved), moved
