"""The shard writer's direct I/O (fsdptk._files.safetensors_writer._ShardOut).

Each write's whole aligned blocks go to the disk with O_DIRECT through a page-aligned staging
buffer, its unaligned head and tail through the page cache; a filesystem that refuses O_DIRECT gets
ordinary writes. Whatever the path and the order of the writes, the files must be byte for byte the
files of ordinary writes (FSDPTK_DIRECT_IO=0) and load with safetensors' own reader.
"""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fsdptk._files import safetensors_writer
from fsdptk._files.safetensors_writer import ShardedWriter, _ShardOut

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _save(d: Path, sd: dict[str, torch.Tensor], order: list[str], max_shard_size: int) -> None:
    w = ShardedWriter(d, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=max_shard_size)
    for k in order:
        w.write(k, sd[k])
    w.commit()


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.endswith((".safetensors", ".json"))}


def _same_names(a: dict[str, bytes], b: dict[str, bytes]) -> None:
    """Shard names are unique per save only where a name exists; in fresh directories they match."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 37), min_size=0, max_size=3)),
                     min_size=1, max_size=8),
    shuffle=st.randoms(use_true_random=False),
    in_order=st.booleans(),
    max_shard_size=st.sampled_from([64, 3000, 1 << 30]),
    stage=st.sampled_from([4096, 8192, 1 << 20]),
)
def test_direct_writes_give_the_bytes_of_ordinary_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         entries, shuffle, in_order: bool,
                                                         max_shard_size: int, stage: int) -> None:
    sd = {f"t{i}": _tensor(dt, tuple(shape), i) for i, (dt, shape) in enumerate(entries)}
    order = list(sd)
    if not in_order:
        shuffle.shuffle(order)
    monkeypatch.setattr(safetensors_writer, "_STAGE", stage)  # several staging buffers per write
    monkeypatch.setattr(safetensors_writer, "_MIN_DIRECT", 0)  # small tensors written directly too
    case = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
    monkeypatch.setenv("FSDPTK_DIRECT_IO", "1")
    _save(case / "direct", sd, order, max_shard_size)
    monkeypatch.setenv("FSDPTK_DIRECT_IO", "0")
    _save(case / "plain", sd, order, max_shard_size)
    direct, plain = _files(case / "direct"), _files(case / "plain")
    _same_names(direct, plain)
    loaded: dict[str, torch.Tensor] = {}
    for name in direct:
        if name.endswith(".safetensors"):
            loaded.update(load_file(case / "direct" / name))
    assert sorted(loaded) == sorted(sd)
    for k, v in sd.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def _supports_direct(d: Path) -> bool:
    try:
        fd = os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o666)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    (d / "probe").unlink()
    return True


def test_whole_blocks_go_direct_heads_and_tails_through_the_cache_in_any_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _supports_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    import fcntl

    real, seen = os.pwrite, []

    def pwrite(fd: int, data, offset: int) -> int:  # noqa: ANN001 - os.pwrite's own signature
        seen.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, len(data)))
        return real(fd, data, offset)

    monkeypatch.setenv("FSDPTK_DIRECT_IO", "1")
    monkeypatch.setattr(safetensors_writer, "_STAGE", 8192)
    monkeypatch.setattr(safetensors_writer, "_MIN_DIRECT", 4096)
    monkeypatch.setattr(os, "pwrite", pwrite)
    a = safetensors_writer._ALIGN
    data = bytes(range(256)) * (12 * a // 256 + 3)
    cut1, cut2 = 5 * a + 100, 9 * a + 7  # pieces written last, first, middle
    out = _ShardOut(tmp_path / "f")
    out.write_at(cut2, memoryview(data[cut2:]))
    out.write_at(0, memoryview(data[:cut1]))
    out.write_at(cut1, memoryview(data[cut1:cut2]))
    out.finish()
    assert (tmp_path / "f").read_bytes() == data
    direct = [(o, n) for d, o, n in seen if d]
    plain = [(o, n) for d, o, n in seen if not d]
    assert direct and all(o % a == 0 and n % a == 0 for o, n in direct), seen
    assert sum(n for _, n in direct) >= len(data) - 4 * a, seen  # all but the blocks at the cuts
    assert all(n < a for _, n in plain), seen  # only heads and tails through the cache
    covered = sorted((o, o + n) for _, o, n in seen)
    assert covered[0][0] == 0 and all(x[1] == y[0] for x, y in itertools.pairwise(covered)), covered


def test_a_filesystem_that_refuses_direct_writes_gets_ordinary_ones(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """open(O_DIRECT) succeeds but the write answers EINVAL (as some filesystems do): the staged
    bytes and the rest are written through the page cache, and the file is the same."""
    if not _supports_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    import fcntl

    real = os.pwrite
    refused = []

    def pwrite(fd: int, data, offset: int) -> int:  # noqa: ANN001 - os.pwrite's own signature
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setenv("FSDPTK_DIRECT_IO", "1")
    monkeypatch.setattr(safetensors_writer, "_STAGE", 8192)
    monkeypatch.setattr(safetensors_writer, "_MIN_DIRECT", 4096)
    monkeypatch.setattr(os, "pwrite", pwrite)
    sd = {f"t{i}": _tensor(torch.float32, (i + 1, 7000), i) for i in range(4)}
    _save(tmp_path / "direct", sd, list(sd), 1 << 30)
    monkeypatch.setenv("FSDPTK_DIRECT_IO", "0")
    _save(tmp_path / "plain", sd, list(sd), 1 << 30)
    assert len(refused) == 1  # refused once, then ordinary writes
    _same_names(_files(tmp_path / "direct"), _files(tmp_path / "plain"))


def test_a_disk_error_in_a_direct_write_fails_the_save_and_leaves_no_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from a direct write is the save's error (not a fallback), and the aborted save
    leaves the directory as it was (no temporary file that looks complete)."""
    if not _supports_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:  # noqa: ANN001 - os.pwrite's own signature
        if len(data) >= 4096 and offset % 4096 == 0:  # a direct write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setenv("FSDPTK_DIRECT_IO", "1")
    monkeypatch.setattr(safetensors_writer, "_STAGE", 8192)
    monkeypatch.setattr(safetensors_writer, "_MIN_DIRECT", 4096)
    sd = {f"t{i}": _tensor(torch.float32, (8, 7000), i) for i in range(3)}
    d = tmp_path / "ckpt"
    w = ShardedWriter(d, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=1 << 30)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space left"):
        for k, v in sd.items():
            w.write(k, v)
    monkeypatch.setattr(os, "pwrite", real)
    w.abort()
    assert [p.name for p in d.iterdir() if not p.name.startswith(".fsdptk.lock")] == []


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("where", ["header", "data"])
@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "plain"])
def test_a_failed_write_leaks_no_descriptor_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               where: str, direct: str) -> None:
    """EDQUOT (which ``shutil.disk_usage`` does not see) on the first header write, or on a
    tensor's: the save fails naming the file and the cause, every descriptor it opened (the
    O_DIRECT one and the plain one) is closed, no temporary file is left, and the next save of the
    directory succeeds."""
    from fsdptk import save_safetensors

    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:  # noqa: ANN001 - os.pwrite's own signature
        if (offset == 0) == (where == "header"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return real(fd, data, offset)

    monkeypatch.setenv("FSDPTK_DIRECT_IO", direct)
    d = tmp_path / "ckpt"
    model = torch.nn.Linear(64, 32)
    save_safetensors(model, d)  # a previous checkpoint: kept as it was
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    fds = _open_fds()
    monkeypatch.setattr(os, "pwrite", pwrite)
    for _ in range(3):
        with pytest.raises(OSError, match=r"'model\.safetensors' \(temporary file .*\): Disk quota exceeded") as info:
            save_safetensors(model, d)
        assert info.value.errno == errno.EDQUOT
    monkeypatch.setattr(os, "pwrite", real)
    assert _open_fds() == fds
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # no temporary file, no lock
    with torch.no_grad():
        model.weight.add_(1)
    save_safetensors(model, d)
    assert torch.equal(load_file(d / "model.safetensors")["weight"], model.weight)
