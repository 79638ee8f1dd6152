"""Parity with torchtune 0.6.1 for the small shared helpers: the meta-device check, the backend
name, the world facts, and ``prepare_mha_for_tp`` (at 2 ranks on a real TP mesh).

The cases are those of torchtune's own tests (``tests/torchtune/training/test_distributed.py``,
which are not shipped in its wheel and have no sdist), run against both libraries; where fsdptk
deliberately differs, the test pins the difference that docs/migration.md states.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torchtune.training as tt

import fsdptk


def _meta_linear() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Linear(3, 3)


def _buffer_on_meta() -> torch.nn.Module:
    model = torch.nn.Linear(3, 3)
    model.register_buffer("buffer", torch.ones(1, device="meta"))
    return model


@pytest.mark.parametrize("make", [_meta_linear, _buffer_on_meta])
def test_validate_no_params_on_meta_device_as_torchtune(make) -> None:
    msgs = []
    for lib in (tt, fsdptk):
        with pytest.raises(RuntimeError, match="Unexpected param or buffer") as err:
            lib.validate_no_params_on_meta_device(make())
        msgs.append(str(err.value))
    assert msgs[1].startswith(msgs[0])  # torchtune's sentence, then the kind, shape and dtype
    for lib in (tt, fsdptk):
        lib.validate_no_params_on_meta_device(torch.nn.Linear(3, 3))  # nothing on meta: silent


@pytest.mark.parametrize("device", ["cuda", "cpu", "xpu", "mps"])
@pytest.mark.parametrize("offload", [False, True])
def test_get_distributed_backend_as_torchtune(device: str, offload: bool) -> None:
    theirs = tt.get_distributed_backend(device, offload_ops_to_cpu=offload)
    ours = fsdptk.get_distributed_backend(device, offload_ops_to_cpu=offload)
    if device == "cpu" and offload:
        # torchtune: "cpu:gloo,cpu:gloo" (the CPU backend named twice); fsdptk: plain "gloo"
        assert (theirs, ours) == ("cpu:gloo,cpu:gloo", "gloo")
    else:
        assert ours == theirs


def test_get_distributed_backend_unknown_device_differs() -> None:
    # torchtune falls back to "nccl" for any device torch does not map; fsdptk refuses: a
    # ValueError for a device type torch knows, torch's RuntimeError for one it does not
    assert tt.get_distributed_backend("ipu") == tt.get_distributed_backend("tpu") == "nccl"
    with pytest.raises(ValueError, match="ipu"):
        fsdptk.get_distributed_backend("ipu")
    with pytest.raises(RuntimeError, match="tpu"):
        fsdptk.get_distributed_backend("tpu")


def test_world_facts_outside_a_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert tt.is_distributed() is fsdptk.is_distributed() is False
    assert tt.get_world_size_and_rank() == fsdptk.get_world_size_and_rank() == (1, 0)
    # a one-process torchrun: torchtune says distributed (WORLD_SIZE >= 1), fsdptk does not
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert (tt.is_distributed(), fsdptk.is_distributed()) == (True, False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tt.is_distributed() is fsdptk.is_distributed() is True


def _world_facts():
    return ((tt.is_distributed(), tt.get_world_size_and_rank()),
            (fsdptk.is_distributed(), fsdptk.get_world_size_and_rank()))


def test_world_facts_in_a_world(world) -> None:
    for rank, (theirs, ours) in enumerate(world(2).run(_world_facts)):
        assert theirs == ours == (True, (2, rank))


def _heads(model: torch.nn.Module) -> dict[str, tuple]:
    return {n: tuple(getattr(m, a, None) for a in ("num_heads", "num_kv_heads", "embed_dim"))
            for n, m in model.named_modules()
            if any(hasattr(m, a) for a in ("num_heads", "num_kv_heads", "embed_dim"))}


def _prepare(num_kv_heads: int):
    """torchtune's and fsdptk's ``prepare_mha_for_tp`` on the same Llama-2 decoder and TP mesh:
    the attributes of every module afterwards, or each library's error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtune.models.llama2 import llama2

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    out = []
    for lib in (tt, fsdptk):
        with torch.device("meta"):
            model = llama2(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads,
                           embed_dim=32, max_seq_len=16)
        before = _heads(model)
        try:
            returned = lib.prepare_mha_for_tp(model, mesh)
            out.append((returned is model, _heads(model)))
        except ValueError as e:
            out.append((str(e), _heads(model) == before))
    return out


def test_prepare_mha_for_tp_as_torchtune(world) -> None:
    for theirs, ours in world(2).run(_prepare, 2):
        assert theirs == ours
        assert theirs[1]["layers.0.attn"] == (2, 1, 16)


def test_prepare_mha_for_tp_error_as_torchtune(world) -> None:
    """1 KV head over 2 TP ranks: torchtune's error sentence; fsdptk also names the module,
    and leaves every module unchanged (torchtune raises at the first bad module)."""
    for (msg_t, _), (msg_o, untouched) in world(2).run(_prepare, 1):
        assert msg_t == "Number of KV heads (1) must be divisible by tensor parallel size (2)."
        assert msg_t.rstrip(".") in msg_o and untouched


@pytest.mark.parametrize("names_to_match", [None, ["tok_embeddings", "output"]])
def test_get_shard_conditions_as_torchtune(names_to_match) -> None:
    from torchtune.models.llama2 import llama2

    with torch.device("meta"):
        model = llama2(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                       max_seq_len=16)
    names = [n for n, _ in model.named_modules()] + ["decoder.layers.1", "layers.x", "layers"]
    modules = dict(model.named_modules())
    for name in names:
        m = modules.get(name, model)
        assert (fsdptk.get_shard_conditions(name, m, names_to_match)
                == tt.get_shard_conditions(name, m, names_to_match)), name
