"""fsdptk.runtime: single-process facts and the same facts inside a real 2-rank world."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdptk
from fsdptk import (
    get_distributed_backend,
    get_world_size_and_rank,
    is_distributed,
    set_torch_num_threads,
    validate_no_params_on_meta_device,
)


def test_single_process_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not is_distributed()
    assert get_world_size_and_rank() == (1, 0)


def test_is_distributed_from_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert is_distributed()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not is_distributed()
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="four"):
        is_distributed()


@pytest.mark.parametrize(
    ("device", "offload", "expected"),
    [
        ("cuda", False, "nccl"),
        ("cuda:1", False, "nccl"),
        ("cpu", False, "gloo"),
        ("cpu", True, "gloo"),
        ("cuda", True, "cuda:nccl,cpu:gloo"),
        ("xpu", False, "xccl"),
        ("mps", False, "gloo"),  # torch's own default_device_backend_map, as torchtune uses
    ],
)
def test_get_distributed_backend(device: str, offload: bool, expected: str) -> None:
    assert get_distributed_backend(device, offload_ops_to_cpu=offload) == expected


def test_get_distributed_backend_rejects_unknown() -> None:
    with pytest.raises((ValueError, RuntimeError), match="tpu|device"):
        get_distributed_backend("tpu")


def test_set_torch_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
        assert set_torch_num_threads() == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        n = set_torch_num_threads()
        assert n >= 1 and torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        self.register_buffer("rope", torch.zeros(4), persistent=False)


def test_validate_no_params_on_meta_device_names_fqn() -> None:
    validate_no_params_on_meta_device(_Net())
    with torch.device("meta"):
        net = _Net()
    # torchtune's wording first (its tests match "Unexpected param or buffer"), then our details
    with pytest.raises(RuntimeError, match=r"^Unexpected param or buffer inner\.0\.weight on meta "
                       r"device\. It is a parameter of shape \(3, 2\), dtype torch\.float32"):
        validate_no_params_on_meta_device(net)
    net.to_empty(device="cpu")
    net.rope = torch.empty(4, device="meta")
    with pytest.raises(RuntimeError, match=r"^Unexpected param or buffer rope on meta device\. "
                       r"It is a buffer of shape \(4,\)"):
        validate_no_params_on_meta_device(net)


def test_import_is_quiet_fast_and_without_torchao() -> None:
    code = (
        "import sys, fsdptk; "
        "assert 'torchao' not in sys.modules, 'torchao imported'; "
        "fsdptk.get_distributed_backend('cpu'); "
        "assert 'torchao' not in sys.modules, 'torchao imported by runtime'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)


def test_public_names_resolve() -> None:
    for name in fsdptk.__all__:
        assert getattr(fsdptk, name) is not None, name
    with pytest.raises(AttributeError, match="no_such_name"):
        fsdptk.no_such_name  # noqa: B018


def _facts() -> tuple[bool, tuple[int, int], int]:
    return is_distributed(), get_world_size_and_rank(), dist.get_rank()


def test_facts_inside_a_world(world) -> None:
    res = world(2).run(_facts)
    assert res == [(True, (2, 0), 0), (True, (2, 1), 1)]


class _Unpicklable(Exception):
    def __reduce__(self):  # noqa: ANN204 - an exception that cannot cross a pipe
        raise TypeError("not picklable")


def _agree_error(bad_ranks: list[int]) -> list[object]:
    from fsdptk._core.dist import all_gather_object, raise_if_any

    views = all_gather_object(dist.get_rank() * 2)
    rank = dist.get_rank()
    err: Exception | None = None
    if rank in bad_ranks:
        err = KeyError(f"model.norm.weight on {rank}") if rank % 2 else ValueError(f"shape {rank}")
    raise_if_any(err)
    return views


def _agree_unpicklable() -> None:
    from fsdptk._core.dist import raise_if_any

    raise_if_any(_Unpicklable("local only") if dist.get_rank() == 0 else None)


def test_all_gather_object_and_raise_if_any_agree_on_every_rank(world) -> None:
    w = world(4)
    assert w.run(_agree_error, []) == [[0, 2, 4, 6]] * 4
    res = w.run(_agree_error, [1], return_exceptions=True)
    assert [r.exc_type for r in res] == ["KeyError"] * 4
    assert all("model.norm.weight on 1" in r.message for r in res)
    assert "rank 1" in res[0].message and "(on rank" not in res[1].message  # rank 1: its own
    # two failing ranks: every rank raises the lowest failing rank's error (the same everywhere)
    res = w.run(_agree_error, [1, 2], return_exceptions=True)
    assert [r.exc_type for r in res] == ["KeyError"] * 4
    assert all("model.norm.weight on 1" in res[i].message and "(on rank 1)" in res[i].message
               for i in (0, 2, 3))
    # an exception class the other ranks cannot rebuild travels as text
    res = w.run(_agree_unpicklable, return_exceptions=True)
    assert res[0].exc_type == "_Unpicklable"
    assert all(r.exc_type in ("_Unpicklable", "RuntimeError") for r in res[1:])
    assert all("local only" in r.message and "rank 0" in r.message for r in res[1:])
