"""Checkpoint files (issue 5): safetensors in/out of sharded models, DCP, converters, bad input.

Round trips go through real files at world sizes 1, 2 and 4 (FSDP and HSDP meshes, shard-on-read
and rank-0-read) and compare bit-exactly with what the safetensors library reads back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from fsdptk._files.safetensors_writer import ShardedWriter
from fsdptk.checkpoint import (
    SafetensorsCheckpoint,
    dcp_to_safetensors,
    load_dcp,
    load_safetensors,
    parse_size,
    safetensors_to_dcp,
    save_dcp,
    save_safetensors,
)
from fsdptk.errors import CheckpointError
from fsdptk.testing import RemoteError
from fsdptk.testing.strategies import build_module, module_specs, random_state_dict

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.float64]


# ----------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
def _file_sd(spec: dict, seed: int) -> dict[str, torch.Tensor]:
    """The HF-style full state dict of a spec: tied aliases stored once, under the first key."""
    sd = random_state_dict(spec, seed)
    seen: set[int] = set()
    out = {}
    for k, v in sd.items():
        if id(v) not in seen:
            seen.add(id(v))
            out[k] = v
    return out


def _read_all(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read with the safetensors library itself."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        out: dict[str, torch.Tensor] = {}
        for f in sorted(set(data["weight_map"].values())):
            out.update(load_file(path / f))
        assert set(out) == set(data["weight_map"])
        assert data["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
        return out
    return load_file(path / "model.safetensors")


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
                           b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k


def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp_shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _shard(model: nn.Module, mesh_shape: tuple[int, ...]) -> None:
    """fully_shard every leaf with parameters, the tied embed/head pair as one unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(mesh_shape)
    tied = [m for n, m in model.named_children() if n in ("embed", "head")]
    for name, m in model.named_modules():
        if name and not list(m.children()) and list(m.parameters(recurse=False)) and m not in tied:
            fully_shard(m, mesh=mesh)
    if tied:
        fully_shard(tied, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _load_save(spec: dict, src: str, dst: str, mesh_shape: tuple[int, ...], shard_on_read: bool | None,
               max_shard_size: int, tied: str) -> tuple[list[str], list[str], bool]:
    model = build_module(spec, "meta")
    if dist.get_world_size() > 1 or mesh_shape != (1,):
        _shard(model, mesh_shape)
    res = load_safetensors(model, src, shard_on_read=shard_on_read, strict=tied == "omit")
    still_tied = (not spec.get("tied")) or model.head.weight is model.embed.weight
    save_safetensors(model, dst, max_shard_size=max_shard_size, tied=tied)
    return sorted(res.missing_keys), sorted(res.unexpected_keys), still_tied


# ----------------------------------------------------------------------------------------------
# single process: format, reader, writer
def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("1.5MiB") == 3 * 2**19
    assert parse_size(7) == 7
    for bad in ("5XB", 0, -1, "abc", True):
        with pytest.raises(ValueError):
            parse_size(bad)


_tensor_specs = st.lists(
    st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 5), max_size=3)),
    min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(specs=_tensor_specs, shard=st.integers(1, 400), seed=st.integers(0, 2**16),
       reverse=st.booleans())
def test_writer_matches_safetensors_library(tmp_path_factory, specs, shard, seed, reverse) -> None:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for i, (dtype, shape) in enumerate(specs):
        sd[f"t{i}.w"] = (torch.randn(shape, generator=gen) * 50).to(dtype)
    d = tmp_path_factory.mktemp("w")
    writer = ShardedWriter(d, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=shard)
    for k in (reversed(list(sd)) if reverse else list(sd)):
        writer.write(k, sd[k])
    out = writer.commit()
    _assert_same(_read_all(d), sd)
    assert out.name == ("model.safetensors" if len(writer.files) == 1 else "model.safetensors.index.json")
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]
    with SafetensorsCheckpoint(d) as ckpt:
        assert set(ckpt) == set(sd) and ckpt.total_size == sum(v.numel() * v.element_size() for v in sd.values())
        for k, v in sd.items():
            assert ckpt.shape(k) == v.shape and ckpt.dtype(k) == v.dtype
            if v.dim() >= 1 and v.shape[0] > 1:
                assert torch.equal(ckpt.get_slice(k)[1:2], v[1:2])


def _sharded(d: Path, n_tensors: int = 6) -> dict[str, torch.Tensor]:
    sd = {f"layers.{i}.weight": torch.randn(4, 8) for i in range(n_tensors)}
    w = ShardedWriter(d, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=300)
    for k, v in sd.items():
        w.write(k, v)
    w.commit()
    return sd


def test_reader_errors_name_the_problem(tmp_path: Path) -> None:
    _sharded(tmp_path)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) == 3
    # an index naming a key its file does not hold
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = shards[0].name
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"'ghost.weight'.*model-00001-of-00003"):
        SafetensorsCheckpoint(tmp_path)
    del data["weight_map"]["ghost.weight"]
    index.write_text(json.dumps(data))
    # truncated shard
    raw = shards[1].read_bytes()
    shards[1].write_bytes(raw[:-7])
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors.*truncated"):
        SafetensorsCheckpoint(tmp_path)
    shards[1].write_bytes(raw)
    # missing shard
    shards[2].unlink()
    with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    # shards left without their index
    index.unlink()
    with pytest.raises(CheckpointError, match="no '\\*.safetensors.index.json'"):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(FileNotFoundError):
        SafetensorsCheckpoint(tmp_path / "nope")


def test_commit_replaces_old_checkpoint_and_keeps_other_files(tmp_path: Path) -> None:
    _sharded(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    new = {"w": torch.arange(6.0)}
    w = ShardedWriter(tmp_path, [("w", torch.float32, (6,))], max_shard_size="1GB")
    w.write("w", new["w"])
    w.commit()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    _assert_same(_read_all(tmp_path), new)
    # an aborted save leaves the previous checkpoint as it was
    w = ShardedWriter(tmp_path, [("v", torch.float32, (3,))], max_shard_size="1GB")
    w.abort()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_plain_model_round_trip_progress_and_rename(tmp_path: Path, capsys) -> None:
    src = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
    out = save_safetensors(src, tmp_path, rename=lambda k: f"model.{k}", progress=True,
                           metadata={"note": "x"})
    err = capsys.readouterr().err
    assert "save" in err and "B" in err  # tqdm byte counter on stderr
    assert sorted(load_file(out)) == sorted(f"model.{k}" for k in src.state_dict())
    dst = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
    res = load_safetensors(dst, tmp_path, rename=lambda k: k.removeprefix("model."), strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    _assert_same(dst.state_dict(), src.state_dict())
    with pytest.raises(ValueError, match="'0.weight' and '0.bias' to 'x'"):
        save_safetensors(src, tmp_path / "c", rename={"0.weight": "x", "0.bias": "x"})
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


# ----------------------------------------------------------------------------------------------
# multi-process round trips


@settings(max_examples=8, deadline=None)
@given(spec=module_specs(max_leaves=6), seed=st.integers(0, 2**16), shard=st.sampled_from([64, 200, 10**9]),
       sor=st.sampled_from([None, True, False]), four=st.sampled_from([(4,), (2, 2)]))
def test_round_trip_across_world_sizes(world, tmp_path_factory, spec, seed, shard, sor, four) -> None:
    """file A -> load at 4 -> save B -> load at 2 -> C -> at 1 -> D -> HSDP at 2 -> E -> FSDP 4 -> F."""
    base = tmp_path_factory.mktemp("rt")
    ref = _file_sd(spec, seed)
    (base / "A").mkdir()
    save_file(ref, base / "A" / "model.safetensors")
    steps = [(4, four, "B"), (2, (2,), "C"), (1, (1,), "D"), (2, (2, 1), "E"), (4, (4,), "F")]
    prev = "A"
    for n, mesh_shape, name in steps:
        results = world(n).run(_load_save, spec, str(base / prev), str(base / name), mesh_shape, sor,
                               shard, "omit")
        for missing, unexpected, still_tied in results:
            assert missing == [] and unexpected == [] and still_tied
        _assert_same(_read_all(base / name), ref)
        prev = name
    shutil.rmtree(base)


def test_tied_both_and_dtype_export(world, tmp_path: Path) -> None:
    spec = {"root": {"type": "seq", "children": [{"type": "linear", "in": 3, "out": 5, "bias": True,
                                                   "dtype": "float32"}]},
            "tied": {"num": 6, "dim": 3, "dtype": "float32"}}
    ref = _file_sd(spec, 1)
    save_file(ref, tmp_path / "model.safetensors")
    world(2).run(_load_save, spec, str(tmp_path), str(tmp_path / "both"), (2,), None, 10**9, "both")
    both = _read_all(tmp_path / "both")
    assert torch.equal(both["head.weight"], both["embed.weight"]) and set(both) == set(ref) | {"head.weight"}
    world(2).run(_save_bf16, spec, str(tmp_path), str(tmp_path / "bf16"))
    bf = _read_all(tmp_path / "bf16")
    assert all(v.dtype == torch.bfloat16 for v in bf.values())
    assert torch.equal(bf["embed.weight"], ref["embed.weight"].to(torch.bfloat16))


def _save_bf16(spec: dict, src: str, dst: str) -> None:
    model = build_module(spec, "meta")
    _shard(model, (dist.get_world_size(),))
    load_safetensors(model, src)
    save_safetensors(model, dst, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# bad input: same error on every rank, no hang, nothing half-written


def _try_load(src: str, shard_on_read: bool | None, rename: dict | None = None) -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(8, 4, bias=False) for _ in range(6)])
    _shard(model, (dist.get_world_size(),))
    load_safetensors(model, src, shard_on_read=shard_on_read, rename=rename)


def _expect_all(world, n: int, fn, *args, exc_type: str, match: str) -> None:
    with pytest.raises(RemoteError) as info:
        world(n).run(fn, *args, timeout=60)
    per_rank = info.value.per_rank
    assert per_rank is not None and len(per_rank) == n
    for r in per_rank:
        assert isinstance(r, RemoteError), per_rank
        assert r.exc_type == exc_type, (r.exc_type, r.message)
        assert match in r.message, r.message


@pytest.mark.parametrize("shard_on_read", [None, False])
def test_bad_checkpoints_fail_on_every_rank(world, tmp_path: Path, shard_on_read) -> None:
    sd = _sharded(tmp_path)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["layers.9.weight"] = shards[0].name
    index.write_text(json.dumps(data))
    _expect_all(world, 2, _try_load, str(tmp_path), shard_on_read, exc_type="CheckpointError",
                match="'layers.9.weight'")
    del data["weight_map"]["layers.9.weight"]
    index.write_text(json.dumps(data))
    raw = shards[1].read_bytes()
    shards[1].write_bytes(raw[: len(raw) // 2])
    _expect_all(world, 2, _try_load, str(tmp_path), shard_on_read, exc_type="CheckpointError",
                match="model-00002-of-00003.safetensors")
    shards[1].write_bytes(raw)
    _expect_all(world, 2, _try_load, str(tmp_path), shard_on_read,
                {"layers.0.weight": "layers.1.weight"}, exc_type="ValueError",
                match="'layers.0.weight' and 'layers.1.weight' to 'layers.1.weight'")
    shards[2].unlink()
    _expect_all(world, 2, _try_load, str(tmp_path), shard_on_read, exc_type="FileNotFoundError",
                match="model-00003-of-00003.safetensors")
    assert len(sd) == 6


def _save_linear_stack(dst: str, seed: int, fsize_limit: int | None) -> None:
    import resource
    import signal

    torch.manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
    _shard(model, (dist.get_world_size(),))
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if fsize_limit is not None and dist.get_rank() == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, old_limit[1]))
    try:
        save_safetensors(model, dst, max_shard_size=6000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_failed_save_keeps_previous_checkpoint(world, tmp_path: Path) -> None:
    world(2).run(_save_linear_stack, str(tmp_path), 0, None)
    (tmp_path / "config.json").write_text('{"model_type": "x"}')
    before = _snapshot(tmp_path)
    assert len(before) == 4 + 2  # 4 shards + index + config
    # rank 0 hits the file size limit half way through the second shard
    _expect_all(world, 2, _save_linear_stack, str(tmp_path), 1, 3000, exc_type="OSError",
                match="File too large")
    assert _snapshot(tmp_path) == before  # nothing new, nothing lost, no temporary file
    # an unwritable target: every rank raises, nothing created
    if os.geteuid() == 0:
        target = "/sys/fsdptk-checkpoint-test/ckpt"  # sysfs refuses mkdir even to root
        exc = "PermissionError"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target, exc = str(ro / "ckpt"), "PermissionError"
    _expect_all(world, 2, _save_linear_stack, target, 0, None, exc_type=exc, match="ckpt")
    assert not Path(target).exists()


# ----------------------------------------------------------------------------------------------
# DCP and converters


def _train_and_save_dcp(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    _shard(model, (dist.get_world_size(),))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).pow(2).sum().backward()
    opt.step()
    save_dcp(model, path, opt, extra={"step": 3, "name": "run"})
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for fqn, p in model.named_parameters():
        full[f"exp_avg.{fqn}"] = opt.state[p]["exp_avg"].full_tensor()
    return full


def _load_dcp_plain(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    if dist.get_world_size() > 1:
        _shard(model, (dist.get_world_size(),))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    extra = load_dcp(model, path, opt)
    get = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    full = {k: get(v) for k, v in model.state_dict().items()}
    for fqn, p in model.named_parameters():
        full[f"exp_avg.{fqn}"] = get(opt.state[p]["exp_avg"])
    return extra, full


def test_dcp_resume_across_world_sizes_and_converters(world, tmp_path: Path) -> None:
    ref = world(2).run(_train_and_save_dcp, str(tmp_path / "dcp"))[0]
    assert (tmp_path / "dcp" / ".metadata").is_file()
    assert sorted(os.listdir(tmp_path)) == ["dcp"]  # the staging directory is gone
    for n in (1, 4):
        for extra, full in world(n).run(_load_dcp_plain, str(tmp_path / "dcp")):
            assert extra == {"step": 3, "name": "run"}
            _assert_same(full, ref)
    # offline DCP -> safetensors (3 files) -> DCP, model entries only
    dcp_to_safetensors(tmp_path / "dcp", tmp_path / "hf", max_shard_size=100)
    model_ref = {k: v for k, v in ref.items() if not k.startswith("exp_avg.")}
    _assert_same(_read_all(tmp_path / "hf"), model_ref)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    safetensors_to_dcp(tmp_path / "hf", tmp_path / "dcp2")
    with pytest.raises(CheckpointError, match="no tensor under prefix 'optim.'"):
        dcp_to_safetensors(tmp_path / "dcp2", tmp_path / "x", prefix="optim.")
    dcp_to_safetensors(tmp_path / "dcp2", tmp_path / "hf2", max_shard_size="1GB")
    _assert_same(_read_all(tmp_path / "hf2"), model_ref)
    m = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    assert load_dcp(m, tmp_path / "dcp2") == {}
    _assert_same(m.state_dict(), model_ref)


def _load_rank_local(paths: list[str], shard_on_read: bool | None) -> list[float]:
    """Load from a path that differs per rank (as when only rank 0 has the files)."""
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(8, 4, bias=False) for _ in range(6)])
    _shard(model, (dist.get_world_size(),))
    load_safetensors(model, paths[dist.get_rank()], shard_on_read=shard_on_read, strict=True)
    return [float(p.detach().full_tensor().sum()) for p in model.parameters()]


def test_auto_falls_back_to_rank0_read_when_others_cannot_see_files(world, tmp_path: Path) -> None:
    sd = _sharded(tmp_path / "ckpt")
    paths = [str(tmp_path / "ckpt")] + [str(tmp_path / f"elsewhere{r}") for r in range(1, 4)]
    expected = [float(sd[f"layers.{i}.weight"].sum()) for i in range(6)]
    for sums in world(4).run(_load_rank_local, paths, None):
        assert sums == pytest.approx(expected, rel=0, abs=0)
    _expect_all(world, 4, _load_rank_local, paths, True, exc_type="FileNotFoundError",
                match="elsewhere1")
    # rank 0 cannot see them: auto mode cannot fall back, every rank raises rank 0's error
    _expect_all(world, 2, _load_rank_local, [paths[1], paths[0]], None, exc_type="FileNotFoundError",
                match="elsewhere1")


def _save_nf4(dst: str) -> torch.Tensor:
    from torch.distributed.fsdp import fully_shard

    from fsdptk.nf4 import dequantize, to_nf4

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128, bias=False, dtype=torch.bfloat16),
                          nn.Linear(128, 8, dtype=torch.bfloat16))
    weight = to_nf4(model[0].weight.detach())
    model[0].weight = nn.Parameter(weight, requires_grad=False)
    fully_shard(model[0])
    fully_shard(model)
    save_safetensors(model, dst)
    return dequantize(weight)


def test_nf4_is_saved_dequantised(world, tmp_path: Path) -> None:
    ref = world(2).run(_save_nf4, str(tmp_path))[0]
    out = load_file(tmp_path / "model.safetensors")
    assert out["0.weight"].dtype == torch.bfloat16 and torch.equal(out["0.weight"], ref)


def _mapped_privately(t: torch.Tensor, file: Path) -> bool:
    """Whether ``t``'s memory lies in a private (copy-on-write) mapping of ``file``."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[1].endswith("p") and len(fields) > 5 and fields[5] == str(file)
    return False


def _load_then_overwrite(src: str, dtype: str) -> dict:
    """Load shard-on-read; a save into the same directory and a write into the model afterwards
    change neither the loaded model nor the file it was read from."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(1)
    dt = getattr(torch, dtype)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 32, dtype=dt), nn.Linear(32, 8, dtype=dt))
    _shard(model, (dist.get_world_size(),))
    load_safetensors(model, src, shard_on_read=True)
    local = model[0].weight.to_local() if isinstance(model[0].weight, DTensor) else model[0].weight
    viewed = _mapped_privately(local, Path(src).resolve() / "model.safetensors")
    before = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        other = nn.Sequential(nn.Linear(64, 32, dtype=dt), nn.Linear(32, 8, dtype=dt))
    other.to_empty(device="cpu")
    for p in other.parameters():
        nn.init.constant_(p, 7.0)
    _shard(other, (dist.get_world_size(),))
    save_safetensors(other, src)  # a new file renamed over the one the model was read from
    after = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    intact = all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():  # a write makes the pages private: the (new) file never sees it
        for p in model.parameters():
            p.to_local().add_(1) if isinstance(p, DTensor) else p.add_(1)
    dist.barrier()
    return {"viewed": viewed, "intact": intact,
            "file": {k: float(v.float().sum()) for k, v in load_file(Path(src) / "model.safetensors").items()}}


@pytest.mark.parametrize("dtype, viewed", [("float32", True), ("bfloat16", False)])
def test_shard_on_read_keeps_copy_on_write_views_of_the_file(world, tmp_path: Path, dtype, viewed) -> None:
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    save_safetensors(src, tmp_path)  # float32 in the file; a bfloat16 model is a cast (a copy)
    for r in world(2).run(_load_then_overwrite, str(tmp_path), dtype):
        assert r["viewed"] is viewed
        assert r["intact"]
        assert r["file"] == {"0.weight": 7.0 * 64 * 32, "0.bias": 7.0 * 32, "1.weight": 7.0 * 32 * 8,
                             "1.bias": 7.0 * 8}
