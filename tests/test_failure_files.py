"""Failure model, files (issue 13): no code runs from a checkpoint, nothing is read outside the
directory named, commits are crash-safe at every step, one writer per target, nothing deleted that
fsdptk did not write, no traceback from the CLI.

Crash safety is tested by a hook at every commit step that copies the directory as a kill at that
instant would leave it (the files are fsync-ed before each rename), then loading the copy (it must be
the complete old or the complete new checkpoint) and saving into it again (it must recover and clean
up); one test also SIGKILLs a real writer in the middle of its commit.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pathlib
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import fsdptk._files.commit as commit
from fsdptk._files.common import rename_keys
from fsdptk._files.lock import DirectoryLock
from fsdptk._files.safetensors_writer import ShardedWriter
from fsdptk.checkpoint import (
    SafetensorsCheckpoint,
    dcp_to_safetensors,
    load_dcp,
    load_safetensors,
    safetensors_to_dcp,
    save_dcp,
    save_safetensors,
)
from fsdptk.cli import main
from fsdptk.errors import CheckpointError, CheckpointLockedError
from fsdptk.testing import RemoteError

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# helpers
class _Exec:
    """A pickle whose loading runs ``exec(code)`` (what a malicious checkpoint would carry)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (builtins.exec, (self.code,))


def _touch_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


@pytest.fixture(autouse=True)
def _no_hang():
    """A FIFO or a lock must never block: any test here that takes 60 s fails instead of hanging."""
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("hung")))
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _err_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdptk {command}: error:"), err
    return lines[0]


def _write(d: Path, sd: dict[str, torch.Tensor], max_shard_size: int | str) -> None:
    w = ShardedWriter(d, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=max_shard_size)
    for k, v in sd.items():
        w.write(k, v)
    w.commit()


def _sd(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((4, 8), value + i) for i in range(n)}


def _read(d: Path) -> dict[str, torch.Tensor]:
    with SafetensorsCheckpoint(d) as ckpt:
        return {k: ckpt[k] for k in ckpt}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _dcp_dir(path: Path) -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    save_dcp(model, path, extra={"step": 1})
    return model


# ----------------------------------------------------------------------------------------------
# 1. no deserialisation that can run code
def _evil_metadata(d: Path, marker: Path, how: str) -> None:
    code = _touch_code(marker)
    if how == "top-level":
        obj = _Exec(code)
    else:  # a real Metadata object carrying the gadget inside (planner_data)
        from fsdptk._files.safe_pickle import safe_reader

        obj = safe_reader(d).read_metadata()
        obj.planner_data = {"model.weight": _Exec(code)}
    (d / ".metadata").write_bytes(pickle.dumps(obj))


def _pickled_path(module: str, cls: str, text: str) -> bytes:
    """Protocol-2 pickle bytes of ``module.cls(text)`` as another Python version writes them."""
    raw = text.encode()
    return (b"\x80\x02c" + module.encode() + b"\n" + cls.encode() + b"\n"
            + b"X" + len(raw).to_bytes(4, "little") + raw + b"\x85R.")


@settings(max_examples=25, deadline=None)
@given(module=st.sampled_from(["pathlib", "pathlib._local"]),
       cls=st.sampled_from(["PosixPath", "PurePosixPath", "Path"]),
       parts=st.lists(st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1,
                              max_size=8), min_size=1, max_size=4))
def test_dcp_metadata_paths_read_under_every_python_version(module: str, cls: str,
                                                            parts: list[str]) -> None:
    """A checkpoint's pickled paths name ``pathlib`` (up to Python 3.12) or ``pathlib._local``
    (3.13 on); both resolve to this interpreter's class of that name, and nothing else does."""
    from fsdptk._files.safe_pickle import MetadataUnpickler

    text = "/" + "/".join(parts)
    got = MetadataUnpickler(io.BytesIO(_pickled_path(module, cls, text))).load()
    assert type(got) is type(getattr(pathlib, cls)(text)), (module, cls, type(got))
    assert str(got) == text
    # a written checkpoint's own metadata round-trips through the same unpickler
    assert MetadataUnpickler(io.BytesIO(pickle.dumps(got))).load() == got
    with pytest.raises(pickle.UnpicklingError, match=f"{module}.os is not a DCP metadata type"):
        MetadataUnpickler(io.BytesIO(_pickled_path(module, "os", text))).load()


@pytest.mark.parametrize("how", ["top-level", "nested"])
def test_dcp_metadata_pickle_runs_no_code(tmp_path: Path, capsys, how: str) -> None:
    src = tmp_path / "dcp"
    _dcp_dir(src)
    marker = tmp_path / "PWNED"
    _evil_metadata(src, marker, how)
    with pytest.raises(CheckpointError, match="builtins.exec is not a DCP metadata type"):
        load_dcp(nn.Linear(3, 2), src)
    with pytest.raises(CheckpointError, match="builtins.exec is not a DCP metadata type"):
        dcp_to_safetensors(src, tmp_path / "hf")
    assert main(["inspect", str(src)]) == 1
    assert "builtins.exec is not a DCP metadata type" in _err_line(capsys, "inspect")
    assert main(["convert", str(src), str(tmp_path / "hf2")]) == 1
    assert "builtins.exec is not a DCP metadata type" in _err_line(capsys, "convert")
    assert not marker.exists()
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").glob("*.safetensors"))


def test_dcp_values_are_read_weights_only(tmp_path: Path) -> None:
    """``extra`` (and every non-tensor DCP value) is read with ``weights_only=True``."""
    marker = tmp_path / "PWNED"
    model = nn.Linear(3, 2)
    state = {"model": model.state_dict(), "extra": io.BytesIO(pickle.dumps(_Exec(_touch_code(marker))))}
    dcp.save(state, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    with pytest.raises(CheckpointError, match="DCP entry 'extra' is not plain data"):
        load_dcp(nn.Linear(3, 2), tmp_path / "a")
    # a non-tensor value DCP pickles itself (as an optimizer hyper-parameter is)
    state = {"model": model.state_dict(), "extra": _Exec(_touch_code(marker))}
    dcp.save(state, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    with pytest.raises(CheckpointError, match="DCP entry 'extra' is not plain data"):
        load_dcp(nn.Linear(3, 2), tmp_path / "b")
    assert not marker.exists()
    # a torch.save file: inspect reads it with weights_only=True
    torch.save({"w": torch.zeros(2), "x": _Exec(_touch_code(marker))}, tmp_path / "evil.pt")
    assert main(["inspect", str(tmp_path / "evil.pt")]) == 1
    assert not marker.exists()


def test_extra_round_trips_plain_data_and_refuses_objects(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    extra = {"step": 7, "rng": torch.get_rng_state(), "pos": [1, (2, 3)], "name": None}
    save_dcp(model, tmp_path / "c", opt, extra=extra)
    m2 = nn.Linear(3, 2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    got = load_dcp(m2, tmp_path / "c", o2)
    assert got["step"] == 7 and got["pos"] == [1, (2, 3)] and torch.equal(got["rng"], extra["rng"])
    assert o2.param_groups[0]["lr"] == 0.01 and o2.param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(TypeError, match="extra must hold only tensors.*Unsupported global"):
        save_dcp(model, tmp_path / "c", extra={"obj": _Exec("pass")})


# ----------------------------------------------------------------------------------------------
# 2. convert never over its source
def _hf_dir(d: Path) -> dict[str, torch.Tensor]:
    d.mkdir(parents=True, exist_ok=True)
    sd = {"w": torch.arange(6.0).reshape(2, 3)}
    save_file(sd, d / "model.safetensors")
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    return sd


@pytest.mark.parametrize("dst", ["same", "inside", "contains", "symlink"])
def test_convert_refuses_destination_overlapping_source(tmp_path: Path, capsys, dst: str) -> None:
    src = tmp_path / "models" / "hf"
    _hf_dir(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    (tmp_path / "link").symlink_to(src)
    target = {"same": src, "inside": src / "dcp", "contains": src.parent, "symlink": tmp_path / "link"}[dst]
    assert main(["convert", str(src), str(target), "--to", "dcp"]) == 1
    assert "would destroy the source" in _err_line(capsys, "convert")
    with pytest.raises(ValueError, match="would destroy the source"):
        safetensors_to_dcp(src, target)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_dcp_to_safetensors_refuses_overlap(tmp_path: Path) -> None:
    _dcp_dir(tmp_path / "dcp")
    for target in (tmp_path / "dcp", tmp_path / "dcp" / "hf", tmp_path):
        with pytest.raises(ValueError, match="would destroy the source"):
            dcp_to_safetensors(tmp_path / "dcp", target)
    assert (tmp_path / "dcp" / ".metadata").is_file() and not (tmp_path / "dcp" / "hf").exists()


# ----------------------------------------------------------------------------------------------
# 3. nothing read outside the directory; only regular files opened
@pytest.mark.parametrize("name", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors",
                                  "sub/x.safetensors", ".", ""])
def test_index_entries_must_be_plain_file_names(tmp_path: Path, capsys, name: str) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "outside.safetensors")
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, ckpt / "sub" / "x.safetensors")
    name = str(tmp_path / "outside.safetensors") if name == "ABS" else name
    index = {"metadata": {}, "weight_map": {"w": name}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="only plain file names"):
        SafetensorsCheckpoint(ckpt)
    with pytest.raises(CheckpointError, match="only plain file names"):
        load_safetensors(nn.Module(), ckpt)
    assert main(["inspect", str(ckpt)]) == 1
    assert "only plain file names" in _err_line(capsys, "inspect")


def test_hf_cache_symlinked_blobs_still_load(tmp_path: Path, capsys) -> None:
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    sd = _sd(1.0)
    _write(tmp_path / "made", sd, max_shard_size=300)
    for i, f in enumerate(sorted((tmp_path / "made").iterdir())):
        shutil.copy(f, repo / "blobs" / f"hash{i}")
        (snap / f.name).symlink_to(f"../../blobs/hash{i}")
    assert _same(_read(snap), sd)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(8, 4, bias=False) for _ in range(4)])
    assert not load_safetensors(model, snap, strict=True).missing_keys
    assert torch.equal(model.layers[3].weight, sd["layers.3.weight"])
    assert main(["inspect", str(snap)]) == 0
    assert "layers.3.weight" in capsys.readouterr().out


def test_fifo_and_directories_are_refused_before_opening(tmp_path: Path, capsys) -> None:
    d = tmp_path / "a"
    d.mkdir()
    os.mkfifo(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        SafetensorsCheckpoint(d)
    assert main(["inspect", str(d)]) == 1
    assert "FIFO" in _err_line(capsys, "inspect")
    assert main(["inspect", str(d / "model.safetensors")]) == 1
    assert "FIFO" in _err_line(capsys, "inspect")
    # an index naming a FIFO, and one naming a directory
    b = tmp_path / "b"
    b.mkdir()
    os.mkfifo(b / "model-00001-of-00002.safetensors")
    (b / "model-00002-of-00002.safetensors").mkdir()
    for shard, kind in (("model-00001-of-00002.safetensors", "FIFO"),
                        ("model-00002-of-00002.safetensors", "directory")):
        (b / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        with pytest.raises(CheckpointError, match=f"is a {kind}, not a regular file"):
            SafetensorsCheckpoint(b)
        assert main(["inspect", str(b)]) == 1
        assert kind in _err_line(capsys, "inspect")
    # DCP: a FIFO as .metadata, a FIFO as a data file
    c = tmp_path / "c"
    _dcp_dir(c)
    data = next(c.glob("*.distcp"))
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(CheckpointError, match="is a FIFO"):
        load_dcp(nn.Linear(3, 2), c)
    (c / ".metadata").unlink()
    os.mkfifo(c / ".metadata")
    assert main(["inspect", str(c)]) == 1
    assert "FIFO" in _err_line(capsys, "inspect")


def test_dcp_storage_paths_must_stay_inside(tmp_path: Path) -> None:
    from fsdptk._files.safe_pickle import safe_reader

    _dcp_dir(tmp_path / "d")
    meta = safe_reader(tmp_path / "d").read_metadata()
    for info in meta.storage_data.values():
        info.relative_path = "../outside.distcp"
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="'../outside.distcp': only plain file names"):
        load_dcp(nn.Linear(3, 2), tmp_path / "d")


# ----------------------------------------------------------------------------------------------
# 4. a stale index beside a newer single file
def test_single_file_is_preferred_to_a_stale_index(tmp_path: Path) -> None:
    _write(tmp_path, _sd(1.0), max_shard_size=300)  # index + 3 shards
    new = {"w": torch.zeros(3)}
    save_file(new, tmp_path / "model.safetensors")  # written later by another tool
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.index_file is None and list(ckpt) == ["w"]


# ----------------------------------------------------------------------------------------------
# 5. crash-safe commits, every step
def _snapshots(monkeypatch, root: Path, watch: Path) -> list[tuple[str, Path]]:
    """Copy ``watch`` after every change a commit makes in it, as a crash right there would leave
    it: the file-system calls of ``fsdptk._files.commit`` (renames, the swap, deletions) are wrapped
    for the test. Each copy is named by the commit step that change is."""
    shots: list[tuple[str, Path]] = []

    def shot(name: str, d: Path) -> None:
        if Path(d) == watch:
            dst = root / f"{len(shots):02d}-{name}"
            shutil.copytree(d, dst, symlinks=True)
            shots.append((name, dst))

    def moved(src, dst) -> str:
        name = Path(dst).name
        if name.endswith(".fsdptk-commit.json"):
            return "journal-written"
        if name.endswith(".safetensors.index.json"):
            return "index-committed"
        return "old-moved-aside" if ".fsdptk-old-" in name else "renamed"

    def after(fn, name, where):
        def wrapped(*args):
            out = fn(*args)
            if out is not False:  # exchange: False when nothing changed
                shot(name(*args) if callable(name) else name, where(*args))
            return out
        return wrapped

    monkeypatch.setattr(os, "replace", after(os.replace, moved, lambda src, dst: Path(dst).parent))
    monkeypatch.setattr(os, "rename", after(os.rename, moved, lambda src, dst: Path(dst).parent))
    monkeypatch.setattr(commit, "exchange", after(commit.exchange, "exchanged", lambda a, b: Path(b).parent))
    monkeypatch.setattr(commit, "_delete", after(commit._delete, "old-deleted", lambda d, names, prefix: d))
    monkeypatch.setattr(commit, "_remove_tree", after(commit._remove_tree, "old-deleted", lambda p: p.parent))
    return shots


@pytest.mark.parametrize("old_size, new_size", [(300, 300), (10**9, 300), (300, 10**9), (300, 150)],
                         ids=["sharded-same-names", "single-to-sharded", "sharded-to-single",
                              "sharded-to-more-shards"])
def test_sharded_save_killed_at_every_step_loads_old_or_new(tmp_path: Path, monkeypatch,
                                                            old_size: int, new_size: int) -> None:
    d = tmp_path / "ckpt"
    old, new, newer = _sd(1.0), _sd(100.0), _sd(-5.0)
    _write(d, old, old_size)
    (d / "config.json").write_text('{"model_type": "x"}')
    with monkeypatch.context() as patch:
        shots = _snapshots(patch, tmp_path / "shots", d)
        _write(d, new, new_size)
    assert _same(_read(d), new)
    index_file = d / "model.safetensors.index.json"
    files = len(set(json.loads(index_file.read_text())["weight_map"].values())) if index_file.exists() else 1
    assert [n for n, _ in shots] == ["journal-written", *["renamed"] * files,
                                     *(["index-committed"] if index_file.exists() else []), "old-deleted"]
    for name, shot in shots:
        got = _read(shot)
        assert _same(got, old) or _same(got, new), name
        if name == "old-deleted":
            assert _same(got, new)
        _write(shot, newer, 300)  # the next save recovers (the killed writer's lock is stale)
        assert _same(_read(shot), newer), name
        index = json.loads((shot / "model.safetensors.index.json").read_text())
        left = {p.name for p in shot.iterdir()}  # nothing but the checkpoint and the user's file
        assert left == {"config.json", "model.safetensors.index.json", *index["weight_map"].values()}, name


def test_a_sigkilled_writer_leaves_a_loadable_directory(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    old = _sd(1.0)
    _write(d, old, 300)
    script = f"""
import os, signal, sys, torch
sys.path.insert(0, {str(REPO)!r})
from fsdptk._files.safetensors_writer import ShardedWriter
replace, shards = os.replace, []
def killed_after_the_second_shard_rename(src, dst):
    replace(src, dst)
    if os.path.basename(dst).startswith("model-"):
        shards.append(dst)
        if len(shards) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
os.replace = killed_after_the_second_shard_rename
sd = {{f"layers.{{i}}.weight": torch.full((4, 8), 100.0 + i) for i in range(4)}}
w = ShardedWriter({str(d)!r}, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=300)
for k, v in sd.items():
    w.write(k, v)
w.commit()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (d / ".fsdptk.lock").exists() and _same(_read(d), old)  # killed before the commit
    _write(d, _sd(3.0), 300)  # takes the dead writer's lock over, rolls back its shards
    assert _same(_read(d), _sd(3.0))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert {p.name for p in d.iterdir()} == {"model.safetensors.index.json", *index["weight_map"].values()}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_save_dcp_killed_at_every_step_keeps_a_checkpoint(tmp_path: Path, monkeypatch,
                                                          exchange: bool) -> None:
    root = tmp_path / "runs"
    path = root / "step"
    old, new = nn.Linear(3, 2), nn.Linear(3, 2)
    save_dcp(old, path, extra={"v": "old"})
    if not exchange:
        monkeypatch.setattr(commit, "exchange", lambda a, b: False)
    with monkeypatch.context() as patch:
        shots = _snapshots(patch, tmp_path / "shots", root)
        save_dcp(new, path, extra={"v": "new"})
    names = [n for n, _ in shots]
    expected = ["exchanged"] if exchange else ["old-moved-aside", "renamed"]
    assert names == expected + ["old-deleted"]
    for name, shot in shots:
        m = nn.Linear(3, 2)
        v = load_dcp(m, shot / "step")["v"]  # reads the backup when "step" is missing
        assert torch.equal(m.weight, (old if v == "old" else new).weight), name
        save_dcp(new, shot / "step", extra={"v": "next"})  # recovers, cleans the leftovers
        assert load_dcp(nn.Linear(3, 2), shot / "step") == {"v": "next"}
        assert sorted(os.listdir(shot)) == ["step"], (name, os.listdir(shot))


# ----------------------------------------------------------------------------------------------
# 6. one writer per target
def _save_linear(path: str, fmt: str) -> None:
    model = nn.Linear(4, 2)
    if fmt == "dcp":
        save_dcp(model, path)
    else:
        save_safetensors(model, path)


def test_second_writer_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    holder = ShardedWriter(d, [("w", torch.float32, (2,))], max_shard_size="1GB")
    t0 = time.monotonic()
    pattern = rf"being written by another writer: pid {os.getpid()} \(this process\) on host " \
              rf"'{socket.gethostname()}', since 20\d\d-"
    with pytest.raises(CheckpointLockedError, match=pattern):
        save_safetensors(nn.Linear(4, 2), d)
    assert time.monotonic() - t0 < 5
    holder.write("w", torch.ones(2))
    holder.commit()
    save_safetensors(nn.Linear(4, 2), d)  # released
    assert sorted(os.listdir(d)) == ["model.safetensors"]
    with DirectoryLock(tmp_path / ".step.fsdptk.lock", tmp_path / "step"), \
            pytest.raises(CheckpointLockedError, match="pid"):
        save_dcp(nn.Linear(4, 2), tmp_path / "step")
    save_dcp(nn.Linear(4, 2), tmp_path / "step")


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_locked_target_fails_on_every_rank(world, tmp_path: Path, fmt: str) -> None:
    target = tmp_path / "ckpt"
    lock = (target / ".fsdptk.lock") if fmt == "safetensors" else tmp_path / ".ckpt.fsdptk.lock"
    lock.parent.mkdir(exist_ok=True)
    # the lock is held by this (live) process, another pid than the ranks'
    with DirectoryLock(lock, target), pytest.raises(RemoteError) as info:
        world(2).run(_save_linear, str(target), fmt, timeout=60)
    for r in info.value.per_rank:
        assert isinstance(r, RemoteError) and r.exc_type == "CheckpointLockedError", r
        assert f"pid {os.getpid()}" in r.message


def test_stale_locks_are_taken_over_live_foreign_ones_are_not(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    d = tmp_path / "ckpt"
    d.mkdir()
    lock = d / ".fsdptk.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x", "token": "t"}))
    save_safetensors(nn.Linear(4, 2), d)
    assert not lock.exists()
    lock.write_text(json.dumps({"pid": 1, "host": "other-node-7", "started": "2026-01-01T00:00:00Z",
                                "token": "u"}))
    with pytest.raises(CheckpointLockedError, match="pid 1 on host 'other-node-7', since 2026-01-01"):
        save_safetensors(nn.Linear(4, 2), d)
    lock.write_text("")  # a writer killed while creating its lock: stale after a grace period
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    save_safetensors(nn.Linear(4, 2), d)
    assert sorted(os.listdir(d)) == ["model.safetensors"]


def test_dcp_staging_is_unique_per_save(tmp_path: Path, monkeypatch) -> None:
    seen: list[str] = []
    real = dcp.FileSystemWriter

    def spy(path, *a, **k):
        seen.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(dcp, "FileSystemWriter", spy)
    for _ in range(2):
        save_dcp(nn.Linear(2, 2), tmp_path / "step")
    assert len(set(seen)) == 2 and all(s.startswith(".step.fsdptk-stage-") for s in seen)
    assert os.listdir(tmp_path) == ["step"]


# ----------------------------------------------------------------------------------------------
# 7. never delete what fsdptk did not write
@pytest.mark.parametrize("new_size", [10**9, 300], ids=["new-single", "new-sharded"])
def test_save_never_deletes_files_it_did_not_write(tmp_path: Path, new_size: int) -> None:
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "notes-00001-of-00002.safetensors"):
        (d / name).write_text("{}")
    (tmp_path / "outside.safetensors").write_text("x")
    weight_map = {"a": "config.json", "b": "tokenizer.json", "c": ".", "d": "sub",
                  "e": "../outside.safetensors",
                  "f": "notes-00001-of-00002.safetensors", "g": str(tmp_path / "outside.safetensors")}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _write(d, _sd(2.0), new_size)
    assert _same(_read(d), _sd(2.0))
    for name in ("config.json", "tokenizer.json", "notes-00001-of-00002.safetensors", "sub"):
        assert (d / name).exists(), name
    assert (tmp_path / "outside.safetensors").exists()


# ----------------------------------------------------------------------------------------------
# 8. stale temporary files
def test_stale_temporary_files_are_cleaned_by_the_next_save(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    sd = _sd(1.0)
    killed = ShardedWriter(d, [(k, v.dtype, v.shape) for k, v in sd.items()], max_shard_size=300)
    killed.write("layers.0.weight", sd["layers.0.weight"])
    for fh in killed._handles.values():
        fh.close()
    del killed  # a writer that never committed nor aborted (its process died)
    (d / ".notes.tmp").write_text("the user's")
    (d / ".model-00001-of-00002.safetensors.1a2b3c4d.tmp").write_text("not a name fsdptk writes")
    assert [p for p in os.listdir(d) if "fsdptk-" in p]
    save_safetensors(nn.Linear(4, 2), d)
    assert sorted(os.listdir(d)) == [".model-00001-of-00002.safetensors.1a2b3c4d.tmp", ".notes.tmp",
                                     "model.safetensors"]
    # DCP: a failed save removes its staging directory; stale ones are removed by the next save
    with torch.device("meta"):
        broken = nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="meta"):
        save_dcp(broken, tmp_path / "step")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    (tmp_path / ".step.fsdptk-stage-0123456789ab").mkdir()
    (tmp_path / ".step.dcp-tmp").mkdir()  # not a name fsdptk writes: kept
    (tmp_path / ".other.fsdptk-stage-0123456789ab").mkdir()
    save_dcp(nn.Linear(2, 2), tmp_path / "step")
    assert sorted(os.listdir(tmp_path)) == [".other.fsdptk-stage-0123456789ab", ".step.dcp-tmp", "ckpt",
                                            "step"]


# ----------------------------------------------------------------------------------------------
# 9. the CLI: one line, exit 1, never a traceback
def _st_file(path: Path, header: object, data: bytes = b"") -> None:
    raw = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("case, message", [
    ("json-list", "the header is a JSON list"),
    ("no-dtype", "entry 'w' has no dtype"),
    ("nested", "nested too deeply"),
    ("truncated", "truncated"),
    ("bad-shape", "not a list of non-negative ints"),
])
def test_inspect_bad_safetensors_one_line_exit_1(tmp_path: Path, capsys, case: str, message: str) -> None:
    f = tmp_path / "m.safetensors"
    if case == "json-list":
        _st_file(f, [1, 2])
    elif case == "no-dtype":
        _st_file(f, {"w": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif case == "nested":
        _st_file(f, "[" * 200_000 + "]" * 200_000)
    elif case == "truncated":
        save_file({"w": torch.ones(64)}, f)
        f.write_bytes(f.read_bytes()[:-100])
    else:
        _st_file(f, {"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, b"\0" * 8)
    assert main(["inspect", str(f)]) == 1
    line = _err_line(capsys, "inspect")
    assert message in line and str(f) in line


def test_cli_bad_dcp_and_plan_inputs_one_line_exit_1(tmp_path: Path, capsys, monkeypatch) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / ".metadata").write_bytes(os.urandom(64))
    for argv in (["inspect", str(garbage)], ["convert", str(garbage), str(tmp_path / "o1")]):
        assert main(argv) == 1
        assert "not readable DCP metadata" in _err_line(capsys, argv[0])
    missing = tmp_path / "missing"
    _dcp_dir(missing)
    data = next(missing.glob("*.distcp"))
    data.unlink()
    for argv in (["inspect", str(missing)], ["convert", str(missing), str(tmp_path / "o2")]):
        assert main(argv) == 1
        assert data.name in _err_line(capsys, argv[0])
    monkeypatch.chdir(REPO)
    assert main(["plan", "examples.llama:tiny", "--world-size", "2", "--kwargs", '{"no_such_arg": 1}']) == 1
    assert "no_such_arg" in _err_line(capsys, "plan")


# ----------------------------------------------------------------------------------------------
# 10. `__metadata__` is not a tensor name
def test_rename_to_metadata_key_is_an_error_naming_the_source(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'bias' to '__metadata__'"):
        save_safetensors(nn.Linear(2, 2), tmp_path, rename={"bias": "__metadata__"})
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="checkpoint key 'w' to '__metadata__'"):
        rename_keys(["w"], lambda k: "__metadata__", what="checkpoint key")
    with pytest.raises(CheckpointError, match="'__metadata__'"):
        ShardedWriter(tmp_path, [("__metadata__", torch.float32, (2,))], max_shard_size="1GB")


def test_every_rank_is_told_about_a_bad_index(world, tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(RemoteError) as info:
        world(2).run(_load_into_linear, str(tmp_path), timeout=60)
    assert all(r.exc_type == "CheckpointError" and "only plain file names" in r.message
               for r in info.value.per_rank)


def _load_into_linear(path: str) -> None:
    assert dist.get_world_size() == 2
    load_safetensors(nn.Linear(2, 2), path)


@pytest.mark.parametrize("fails", ["write", "fsync"])
def test_a_failed_lock_write_leaves_no_lock(tmp_path: Path, monkeypatch, fails: str) -> None:
    """EDQUOT while writing the lock file (or syncing it): the save fails naming the lock file and
    the cause, the empty lock file it created is removed, and the next save succeeds at once (not
    CheckpointLockedError for the unreadable lock's grace period)."""
    import errno

    import fsdptk._files.lock as lock_module

    real = getattr(os, fails)

    def quota(*args, **kwargs):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    d = tmp_path / "ckpt"
    d.mkdir()
    monkeypatch.setattr(lock_module.os, fails, quota)  # lock_module.os is os: only while the lock is taken
    try:
        with pytest.raises(OSError, match=r"cannot write the lock file .*\.fsdptk\.lock.*: Disk quota exceeded"):
            DirectoryLock(d / ".fsdptk.lock", d).acquire()
        with pytest.raises(OSError, match="Disk quota exceeded"):
            save_safetensors(nn.Linear(4, 2), d)
    finally:
        monkeypatch.setattr(lock_module.os, fails, real)
    assert os.listdir(d) == []
    t0 = time.monotonic()
    save_safetensors(nn.Linear(4, 2), d)
    assert time.monotonic() - t0 < 30 and sorted(os.listdir(d)) == ["model.safetensors"]
