"""Every per-rank argument that changes what the ranks exchange is agreed in the call's first
exchange (issue 40, item 1): on 2 gloo ranks that pass different values, every rank raises one
ValueError naming the argument and both ranks' values, within the test's time limit (never a
hang), before any file is written (the directory holds the previous checkpoint, byte for byte,
and nothing else) and before the model changes (every local shard as it was).

The calls: ``save_safetensors`` and ``save_safetensors_async`` (``writers``, ``conversion``,
``max_shard_size``, ``tied``, ``dtype``, ``rename``, ``metadata``, ``bucket_bytes``),
``load_safetensors`` (``shard_on_read``, ``conversion``, ``rename``, ``strict``,
``bucket_bytes``), ``fsdptk.hf.from_pretrained`` (``dims`` by its degrees, ``dtype``,
``mp_policy``, ``activation_checkpointing``, the device type, ``shard_on_read``,
``trust_remote_code``), ``save_adapter`` / ``load_adapter`` (``adapter_name``, ``strict``,
``shard_on_read``, ``bucket_bytes``), ``save_dcp`` / ``save_dcp_async`` / ``load_dcp`` (whether
an optimizer or ``extra`` is given, ``strict``). The pure helpers (the stable description of a
value, the message) are checked in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdptk._core.arguments import ArgumentsView, arguments_view, check_arguments, describe

DEFAULT = "<default>"  # a rank that leaves the argument out


# ----------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
def _mine(values: tuple) -> dict:
    """This rank's keyword argument: ``{name: value}``, or nothing for DEFAULT."""
    name, v0, v1 = values
    value = v0 if dist.get_rank() == 0 else v1
    return {} if isinstance(value, str) and value == DEFAULT else {name: value}


def _model() -> nn.Module:
    """A tiny FSDP2 model, the same values on every rank."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every local shard of the model (no collective)."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _unchanged(before: dict[str, torch.Tensor], model: nn.Module) -> bool:
    after = _shards(model)
    return sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)


def _files(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (hidden ones too: locks, staging) with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(path.rglob("*"))} if path.exists() else {}


def _raised(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test compares every rank's error
        return type(e).__name__, str(e)
    return "no error", ""


def _disagreement(call: str, name: str, d0: str, d1: str) -> str:
    return f"{call}: the ranks disagree on {name}: rank 0 passed {d0}, rank 1 passed {d1}; every rank must pass the same value"


def _assert_every_rank(results: list, message: str) -> None:
    assert len(results) == 2
    for rank, (kind, text, *_rest) in enumerate(results):
        assert kind == "ValueError", (rank, kind, text)
        assert message in text, (rank, text)


# ----------------------------------------------------------------------------------------------
# saves: save_safetensors and the background save
def _save(dst: str, values: tuple | None, background: bool) -> tuple[str, str]:
    from fsdptk import save_safetensors, save_safetensors_async

    model = _model()
    kwargs = _mine(values) if values is not None else {}
    if background:
        return _raised(lambda: save_safetensors_async(model, dst, **kwargs).wait())
    return _raised(save_safetensors, model, dst, **kwargs)


SAVE_ARGUMENTS = [
    # the known hang: rank 0 writers=2, rank 1 the default writers=1
    (("writers", 2, DEFAULT), "2", "1"),
    (("conversion", "auto", None), "'auto'", "None"),
    (("max_shard_size", "5GB", 64), "'5GB'", "64"),
    (("tied", "both", DEFAULT), "'both'", "'omit'"),
    (("dtype", torch.bfloat16, DEFAULT), "torch.bfloat16", "None"),
    (("rename", {"0.weight": "first.weight"}, None), "{'0.weight': 'first.weight'}", "None"),
    (("metadata", {"step": "1"}, None), "{'step': '1'}", "None"),
    (("bucket_bytes", 64, DEFAULT), "64", "None"),
]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
@pytest.mark.parametrize(("values", "d0", "d1"), SAVE_ARGUMENTS, ids=[v[0][0] for v in SAVE_ARGUMENTS])
def test_a_save_with_different_arguments_raises_on_every_rank_and_writes_nothing(world, tmp_path, values, d0, d1,
                                                                                 background) -> None:
    dst = tmp_path / "ckpt"
    assert world(2).run(_save, str(dst), None, background, timeout=60) == [("no error", "")] * 2
    before = _files(dst)
    assert "model.safetensors" in before
    results = world(2).run(_save, str(dst), values, background, timeout=60)
    call = "save_safetensors_async" if background else "save_safetensors"
    _assert_every_rank(results, _disagreement(call, values[0], d0, d1))
    assert _files(dst) == before  # the previous checkpoint, byte for byte; nothing new


def test_the_writers_hang_of_issue_40_is_an_error_in_an_empty_directory(world, tmp_path) -> None:
    """Exactly as filed: ``writers=2`` on rank 0, the default on rank 1, a new directory."""
    dst = tmp_path / "new"
    results = world(2).run(_save, str(dst), ("writers", 2, DEFAULT), False, timeout=60)
    _assert_every_rank(results, _disagreement("save_safetensors", "writers", "2", "1"))
    assert not dst.exists()


def _writer_ranks(values: tuple) -> tuple[str, str]:
    from fsdptk._files.writers import writer_ranks

    return _raised(writer_ranks, _mine(values)["writers"])


def test_writer_ranks_names_every_ranks_writers_before_checking_them(world) -> None:
    """The writers' own exchange (a save agrees its arguments before it): rank 1's bad value is
    named beside rank 0's, not raised alone."""
    results = world(2).run(_writer_ranks, ("writers", "host", 5), timeout=60)
    _assert_every_rank(results, _disagreement("writer_ranks", "writers", "'host'", "5"))
    assert world(2).run(_writer_ranks, ("writers", "host", "host"), timeout=60) == [("no error", "")] * 2


# ----------------------------------------------------------------------------------------------
# loads: load_safetensors
def _load(src: str, values: tuple) -> tuple[str, str, bool]:
    from fsdptk import load_safetensors

    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(7.0)
    before = _shards(model)
    kind, text = _raised(load_safetensors, model, src, **_mine(values))
    return kind, text, _unchanged(before, model)


LOAD_ARGUMENTS = [
    (("shard_on_read", True, False), "True", "False"),
    (("conversion", "auto", None), "'auto'", "None"),
    (("rename", {"0.weight": "0.weight"}, DEFAULT), "{'0.weight': '0.weight'}", "None"),
    (("strict", False, DEFAULT), "False", "True"),
    (("bucket_bytes", 64, DEFAULT), "64", "None"),
]


@pytest.mark.parametrize(("values", "d0", "d1"), LOAD_ARGUMENTS, ids=[v[0][0] for v in LOAD_ARGUMENTS])
def test_a_load_with_different_arguments_raises_on_every_rank_and_leaves_the_model(world, tmp_path, values, d0,
                                                                                   d1) -> None:
    src = tmp_path / "ckpt"
    assert world(2).run(_save, str(src), None, False, timeout=60) == [("no error", "")] * 2
    results = world(2).run(_load, str(src), values, timeout=60)
    _assert_every_rank(results, _disagreement("load_safetensors", values[0], d0, d1))
    assert [r[2] for r in results] == [True, True]  # every local shard as it was


def _bad_shard_on_read(src: str) -> tuple[str, str]:
    from fsdptk import load_safetensors

    return _raised(load_safetensors, _model(), src, shard_on_read="yes" if dist.get_rank() == 1 else None)


def test_a_bad_shard_on_read_on_one_rank_is_raised_on_every_rank(world, tmp_path) -> None:
    """Was a TypeError on rank 1 alone, before the first exchange (rank 0 then waited)."""
    src = tmp_path / "ckpt"
    world(2).run(_save, str(src), None, False, timeout=60)
    results = world(2).run(_bad_shard_on_read, str(src), timeout=60)
    _assert_every_rank(results, "load_safetensors: the ranks disagree on shard_on_read: rank 0 passed None, "
                                "rank 1 passed 'yes'")


# ----------------------------------------------------------------------------------------------
# fsdptk.hf.from_pretrained with a tiny Qwen3-MoE
def _qwen3_moe(root: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return _qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


def _from_pretrained(src: str, values: tuple) -> tuple[str, str]:
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained

    kwargs = _mine(values)
    if "dims" in kwargs:
        kwargs["dims"] = ParallelDims(dp_shard=2, ep=kwargs["dims"])
    return _raised(from_pretrained, src, **kwargs)


_DIMS = "ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2, ep={})"
PRETRAINED_ARGUMENTS = [
    # the known bug: both loads succeeded with two different models
    (("dims", 2, 1), _DIMS.format(2), _DIMS.format(1)),
    (("dtype", torch.bfloat16, DEFAULT), "torch.bfloat16", "None"),
    (("activation_checkpointing", True, DEFAULT), "True", "False"),
    (("device", "cpu", DEFAULT), "'cpu'", "None"),
    (("shard_on_read", False, DEFAULT), "False", "None"),
    (("trust_remote_code", True, DEFAULT), "True", "False"),
]


@pytest.mark.parametrize(("values", "d0", "d1"), PRETRAINED_ARGUMENTS, ids=[v[0][0] for v in PRETRAINED_ARGUMENTS])
def test_from_pretrained_with_different_arguments_raises_on_every_rank(world, moe_dir, values, d0, d1) -> None:
    results = world(2).run(_from_pretrained, str(moe_dir), values, timeout=60)
    _assert_every_rank(results, _disagreement("from_pretrained", values[0], d0, d1))


def _mp_policies(src: str) -> tuple[str, str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdptk.hf import from_pretrained

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dist.get_rank() == 0 else None
    return _raised(from_pretrained, src, mp_policy=policy)


def test_from_pretrained_with_different_mixed_precision_raises_on_every_rank(world, moe_dir) -> None:
    results = world(2).run(_mp_policies, str(moe_dir), timeout=60)
    _assert_every_rank(results, "from_pretrained: the ranks disagree on mp_policy: rank 0 passed "
                                "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None")
    assert "rank 1 passed None" in results[0][1]


def _default_dims(src: str) -> tuple[tuple, tuple]:
    """``dims=None`` on rank 0 and the same degrees spelled out on rank 1 agree: one model."""
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained

    dims = None if dist.get_rank() == 0 else ParallelDims(dp_shard=2)
    weight = from_pretrained(src, dims=dims).model.embed_tokens.weight
    return tuple(weight.shape), tuple(weight.to_local().shape)


def test_from_pretrained_agrees_the_same_dims_however_they_are_spelled(world, moe_dir) -> None:
    assert world(2).run(_default_dims, str(moe_dir), timeout=60) == [((128, 64), (64, 64))] * 2


# ----------------------------------------------------------------------------------------------
# PEFT adapters
def _peft_model(seed: int = 0) -> nn.Module:
    import peft
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora)
    model.add_adapter("other", lora)
    return model


def _lora(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def _save_adapter(dst: str, values: tuple | None) -> tuple[str, str]:
    from fsdptk.hf import save_adapter

    return _raised(save_adapter, _peft_model(), dst, **(_mine(values) if values is not None else {}))


def _load_adapter(src: str, values: tuple) -> tuple[str, str, bool]:
    from fsdptk.hf import load_adapter

    model = _peft_model(1)
    before = _lora(model)
    kind, text = _raised(load_adapter, model, src, **_mine(values))
    after = _lora(model)
    return kind, text, all(torch.equal(before[k], after[k]) for k in before)


ADAPTER_SAVES = [(("adapter_name", "other", DEFAULT), "'other'", "'default'"),
                 (("bucket_bytes", 64, DEFAULT), "64", "None")]
ADAPTER_LOADS = ADAPTER_SAVES + [(("strict", False, DEFAULT), "False", "True"),
                                 (("shard_on_read", True, DEFAULT), "True", "None")]


@pytest.mark.parametrize(("values", "d0", "d1"), ADAPTER_SAVES, ids=[v[0][0] for v in ADAPTER_SAVES])
def test_save_adapter_with_different_arguments_raises_on_every_rank_and_writes_nothing(world, tmp_path, values, d0,
                                                                                       d1) -> None:
    pytest.importorskip("peft")
    dst = tmp_path / "adapter"
    assert world(2).run(_save_adapter, str(dst), None, timeout=60) == [("no error", "")] * 2
    before = _files(dst)
    assert "adapter_model.safetensors" in before
    results = world(2).run(_save_adapter, str(dst), values, timeout=60)
    _assert_every_rank(results, _disagreement("save_adapter", values[0], d0, d1))
    assert _files(dst) == before


@pytest.mark.parametrize(("values", "d0", "d1"), ADAPTER_LOADS, ids=[v[0][0] for v in ADAPTER_LOADS])
def test_load_adapter_with_different_arguments_raises_on_every_rank_and_leaves_the_model(world, tmp_path, values,
                                                                                         d0, d1) -> None:
    pytest.importorskip("peft")
    src = tmp_path / "adapter"
    world(2).run(_save_adapter, str(src), None, timeout=60)
    results = world(2).run(_load_adapter, str(src), values, timeout=60)
    _assert_every_rank(results, _disagreement("load_adapter", values[0], d0, d1))
    assert [r[2] for r in results] == [True, True]


# ----------------------------------------------------------------------------------------------
# DCP: whether an optimizer (or extra) is given, load_dcp's strict
def _save_dcp(dst: str, optimizer_on: tuple[int, ...], extra_on: tuple[int, ...], background: bool
              ) -> tuple[str, str]:
    from fsdptk import save_dcp, save_dcp_async

    model = _model()
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if rank in optimizer_on else None
    extra = {"step": 1} if rank in extra_on else None
    if background:
        return _raised(lambda: save_dcp_async(model, dst, opt, extra=extra).wait())
    return _raised(save_dcp, model, dst, opt, extra=extra)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
@pytest.mark.parametrize(("optimizer_on", "extra_on", "name", "d0", "d1"), [
    ((0,), (0, 1), "optimizer", "'SGD'", "None"), ((0, 1), (1,), "extra", "None", "'dict'")],
    ids=["optimizer", "extra"])
def test_save_dcp_with_and_without_an_optimizer_raises_on_every_rank(world, tmp_path, optimizer_on, extra_on, name,
                                                                     d0, d1, background) -> None:
    dst = tmp_path / "dcp"
    assert world(2).run(_save_dcp, str(dst), (0, 1), (0, 1), background, timeout=60) == [("no error", "")] * 2
    before = _files(tmp_path)
    results = world(2).run(_save_dcp, str(dst), optimizer_on, extra_on, background, timeout=60)
    _assert_every_rank(results, _disagreement("save_dcp_async" if background else "save_dcp", name, d0, d1))
    assert _files(tmp_path) == before  # the previous checkpoint; no staging directory, no lock


def _load_dcp(src: str, values: tuple) -> tuple[str, str, bool]:
    from fsdptk import load_dcp

    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(7.0)
    before = _shards(model)
    kwargs = _mine(values)
    if kwargs.pop("optimizer", None):
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    kind, text = _raised(load_dcp, model, src, **kwargs)
    return kind, text, _unchanged(before, model)


@pytest.mark.parametrize(("values", "d0", "d1"), [
    (("strict", False, DEFAULT), "False", "True"), (("optimizer", True, DEFAULT), "'SGD'", "None")],
    ids=["strict", "optimizer"])
def test_load_dcp_with_different_arguments_raises_on_every_rank_and_leaves_the_model(world, tmp_path, values, d0,
                                                                                     d1) -> None:
    src = tmp_path / "dcp"
    world(2).run(_save_dcp, str(src), (0, 1), (), False, timeout=60)
    results = world(2).run(_load_dcp, str(src), values, timeout=60)
    _assert_every_rank(results, _disagreement("load_dcp", values[0], d0, d1))
    assert [r[2] for r in results] == [True, True]


# ----------------------------------------------------------------------------------------------
# the pure helpers (one process)
def test_describe_compares_parallel_dims_by_their_degrees() -> None:
    from fsdptk import ParallelDims

    a, b = ParallelDims(dp_shard=2, ep=2, world_size=2), ParallelDims(dp_shard=-1, ep=2, world_size=2)
    assert describe(a) == describe(b) == "ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2, ep=2)"
    assert describe(ParallelDims(dp_shard=2, ep=1, world_size=2)) != describe(a)


def _conversion():
    from fsdptk.conversions import Conversion, Convert, Rename, Stack, Transform

    return Conversion(Rename("tok.weight", "embed.weight"),
                      Convert("layers.*.experts.#.w", "layers.*.experts.w",
                              [Stack(0), Transform(lambda t: t * 2, lambda t: t / 2)]))


def test_describe_is_the_same_for_equal_values_built_twice() -> None:
    """Two builds of one declared conversion hold different function objects (their ``repr``
    shows different addresses, as two processes would): the descriptions are equal."""
    one, two = _conversion(), _conversion()
    assert repr(one) != repr(two)
    assert describe(one) == describe(two)
    assert " at 0x" not in describe(one) and "sha256" in describe(one)  # long: a head and a digest
    ops = describe(_conversion().rules[1].ops)  # the operations: dataclasses, functions by name
    assert ops.startswith(f"[Stack(dim=0), Transform(forward={__name__}._conversion.<locals>.<lambda>, "
                          f"inverse={__name__}._conversion.<locals>.<lambda>, shape=None"), ops
    assert describe(torch.device("cpu")) == "cpu" and describe(torch.float16) == "torch.float16"
    assert describe(_conversion) == f"{__name__}._conversion"
    assert describe(Path(".")) == repr(str(Path(".").resolve()))


def test_describe_keeps_long_values_apart_by_a_digest() -> None:
    big = {f"layers.{i}.weight": f"l{i}" for i in range(100)}
    other = {**big, "layers.99.weight": "changed"}
    assert len(describe(big)) < 300 and "sha256" in describe(big)
    assert describe(big) != describe(other)
    assert describe(big) == describe(dict(big))


def test_the_message_groups_ranks_by_value_and_names_every_argument() -> None:
    views = [arguments_view("save_safetensors", writers=w, tied=t, dtype=None)
             for w, t in ((2, "omit"), (2, "omit"), (1, "omit"), (1, "both"))]
    with pytest.raises(ValueError) as info:
        check_arguments(views)
    assert str(info.value) == (
        "save_safetensors: the ranks disagree on writers: ranks 0, 1 passed 2, ranks 2, 3 passed 1; "
        "on tied: ranks 0-2 passed 'omit', rank 3 passed 'both'; every rank must pass the same values")
    check_arguments(views[:2])  # equal views: nothing raised


def test_ranks_in_different_calls_are_named() -> None:
    views = [ArgumentsView("save_safetensors", ()), ArgumentsView("load_safetensors", ())]
    with pytest.raises(ValueError, match="rank 0 in save_safetensors, rank 1 in load_safetensors"):
        check_arguments(views)


def test_one_rank_passing_an_argument_the_other_does_not_know() -> None:
    views = [arguments_view("load_dcp", strict=True), arguments_view("load_dcp")]
    with pytest.raises(ValueError, match="strict: rank 0 passed True, rank 1 passed <nothing>"):
        check_arguments(views)


# ----------------------------------------------------------------------------------------------
# model and optimizer state: the loads fold the arguments into the engine's one metadata exchange,
# the gathers agree them before it
def _state_call(call: str, values: tuple) -> tuple[str, str, bool]:
    """``call`` with this rank's argument; the error and whether every local shard (and, for the
    optimizer load, every optimizer state tensor) is unchanged."""
    from fsdptk import (
        gather_cpu_state_dict,
        get_full_optimizer_state_dict,
        iter_full_optimizer_state,
        iter_full_state_dict,
        load_from_full_model_state_dict,
        load_from_full_optimizer_state_dict,
    )

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    before = _shards(model)
    moments = [opt.state[p]["momentum_buffer"].to_local().clone() for p in model.parameters()]
    full = {k: torch.full(v.shape, 7.0) for k, v in model.state_dict().items()}
    kwargs = _mine(values)
    if call == "load_from_full_model_state_dict":
        kind, text = _raised(load_from_full_model_state_dict, model, full if dist.get_rank() == 0 else {}, "cpu",
                             **{"broadcast_from_rank0": True, **kwargs})
    elif call == "gather_cpu_state_dict":
        kind, text = _raised(gather_cpu_state_dict, model, dist.get_rank() == 0, **kwargs)
    elif call == "iter_full_state_dict":
        kind, text = _raised(lambda: list(iter_full_state_dict(model, **kwargs)))
    elif call == "get_full_optimizer_state_dict":
        kind, text = _raised(get_full_optimizer_state_dict, model, opt, dist.get_rank() == 0, **kwargs)
    elif call == "iter_full_optimizer_state":
        kind, text = _raised(lambda: list(iter_full_optimizer_state(model, opt, **kwargs)))
    else:
        osd = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
        mine = osd if dist.get_rank() == 0 or not kwargs.get("broadcast_from_rank0", False) else {}
        if dist.get_rank() != 0 and "broadcast_from_rank0" in kwargs and not kwargs["broadcast_from_rank0"]:
            mine = {}  # a rank that believes it reads, holding nothing: the disagreement must win
        kind, text = _raised(load_from_full_optimizer_state_dict, model, opt, mine, "cpu", **kwargs)
    after = [opt.state[p]["momentum_buffer"].to_local() for p in model.parameters()]
    return kind, text, _unchanged(before, model) and all(torch.equal(a, b) for a, b in zip(moments, after))


STATE_ARGUMENTS = [
    ("load_from_full_model_state_dict", ("strict", True, False), "True", "False"),
    ("load_from_full_model_state_dict", ("bucket_bytes", 64, DEFAULT), "64", "None"),
    ("load_from_full_model_state_dict", ("broadcast_from_rank0", True, False), "True", "False"),
    ("gather_cpu_state_dict", ("bucket_bytes", 64, DEFAULT), "64", "None"),
    ("gather_cpu_state_dict", ("adapter_weights_only", True, False), "True", "False"),
    ("iter_full_state_dict", ("bucket_bytes", 64, DEFAULT), "64", "None"),
    ("get_full_optimizer_state_dict", ("bucket_bytes", 64, DEFAULT), "64", "None"),
    ("iter_full_optimizer_state", ("bucket_bytes", 64, DEFAULT), "64", "None"),
    ("load_from_full_optimizer_state_dict", ("broadcast_from_rank0", True, False), "True", "False"),
    ("load_from_full_optimizer_state_dict", ("strict", True, False), "True", "False"),
]


@pytest.mark.parametrize(("call", "values", "d0", "d1"), STATE_ARGUMENTS,
                         ids=[f"{c}-{v[0]}" for c, v, *_ in STATE_ARGUMENTS])
def test_state_calls_with_different_arguments_raise_on_every_rank_and_change_nothing(world, call, values, d0,
                                                                                    d1) -> None:
    results = world(2).run(_state_call, call, values, timeout=60)
    _assert_every_rank(results, _disagreement(call, values[0], d0, d1))
    assert [unchanged for *_, unchanged in results] == [True, True]
