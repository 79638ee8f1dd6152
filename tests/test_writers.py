"""Many writers for one Hugging Face checkpoint (issue 34): ``save_safetensors(..., writers=W)``.

On 4 gloo ranks (FSDP, FSDP x TP with the model's own plan, HSDP), a tiny Llama and a tiny
Qwen3-MoE saved with ``writers=4`` hold exactly the tensors ``writers=1`` writes (one index), and
transformers' ``from_pretrained`` loads them; the bytes each rank writes (``/proc/self/io``
``write_bytes``) are within 1.5x of an even share. A writer whose writes fail for real (the
file-size limit, ``RLIMIT_FSIZE``, on one rank) leaves the previous checkpoint as it was and every
rank raises its error naming it. The background save takes ``writers`` too. Only the tests that
build a transformers model need transformers; the file-to-writer assignment's properties are in
tests/test_writer_assignment.py.
"""

from __future__ import annotations

import json
import resource
import signal
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from fsdptk.testing import RemoteError

MESHES = {"fsdp": {"dp_shard": 4}, "tp": {"dp_shard": 2, "tp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 2}}


# ----------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
def _tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with the safetensors library; checks that the
    index lists exactly the files' keys."""
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        out.update(load_file(f))
    index = path / "model.safetensors.index.json"
    if len(files) > 1:
        data = json.loads(index.read_text())
        assert set(data["weight_map"]) == set(out)
        assert set(data["weight_map"].values()) == {f.name for f in files}
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _written_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/self/io")


def _transformers() -> ModuleType:
    """transformers, or a skip of the test that needs it (the others run without it)."""
    return pytest.importorskip("transformers")


def _llama(root: Path) -> Path:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


def _qwen3_moe(root: Path) -> Path:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=250, num_experts_per_tok=2,
                                         num_experts=8, moe_intermediate_size=16, intermediate_size=64,
                                         head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


def _save_both(src: str, dims_kw: dict, out: str, max_shard_size: int | str) -> int:
    """Load ``src`` on the mesh; save with one writer, then with every rank a writer; the bytes
    this rank wrote (to storage) during the second save."""
    from fsdptk import ParallelDims, save_safetensors
    from fsdptk.hf import from_pretrained

    model = from_pretrained(src, dims=ParallelDims(**dims_kw))
    save_safetensors(model, f"{out}/w1", max_shard_size=max_shard_size)
    dist.barrier()
    before = _written_bytes()
    save_safetensors(model, f"{out}/w4", max_shard_size=max_shard_size, writers=dist.get_world_size())
    return _written_bytes() - before


def _check_loads_in_transformers(src: Path, saved: Path) -> None:
    transformers = _transformers()
    ref = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
    _assert_same(got, ref)


# ----------------------------------------------------------------------------------------------
# the same checkpoint, about 1/W of the bytes each
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_four_writers_write_what_one_writes_each_a_quarter(world, llama, tmp_path, mesh) -> None:
    written = world(4).run(_save_both, str(llama), MESHES[mesh], str(tmp_path), "5GB")
    one, four = _tensors(tmp_path / "w1"), _tensors(tmp_path / "w4")
    _assert_same(four, one)
    assert len(list((tmp_path / "w4").glob("*.index.json"))) == 1
    files = sorted((tmp_path / "w4").glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    share = total / 4
    assert len(files) >= 16  # cut at about 1 / (4 W) of the model: 5GB alone would give one file
    for rank, n in enumerate(written):
        assert share / 1.5 <= n <= share * 1.5, (rank, n, share, written)
    _check_loads_in_transformers(llama, tmp_path / "w4")


def test_moe_hub_layout_with_fused_tensors_across_files(world, tmp_path) -> None:
    """Qwen3-MoE's fused experts (``gate_up_proj``) go back to per-expert Hub tensors in each
    writer's own files, also where one fused tensor's pieces land in several files."""
    src = _qwen3_moe(tmp_path / "src")
    world(4).run(_save_both, str(src), MESHES["tp"], str(tmp_path), "5GB")
    four = _tensors(tmp_path / "w4")
    _assert_same(four, _tensors(tmp_path / "w1"))
    _assert_same(four, _tensors(src))  # the Hub layout save_pretrained wrote
    weight_map = json.loads((tmp_path / "w4" / "model.safetensors.index.json").read_text())["weight_map"]
    fused_files = {weight_map[f"model.layers.0.mlp.experts.{e}.{p}.weight"]
                   for e in range(8) for p in ("gate_proj", "up_proj")}
    assert len(fused_files) > 1  # one model tensor's Hub pieces span several files
    _check_loads_in_transformers(src, tmp_path / "w4")


# ----------------------------------------------------------------------------------------------
# a failing writer
def _linear_stack(seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _save_with_limit(dst: str, seed: int, writers: int | str, limited_rank: int | None) -> str:
    from fsdptk import save_safetensors

    model = _linear_stack(seed)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    if dist.get_rank() == limited_rank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, old_limit[1]))
    try:
        return save_safetensors(model, dst, writers=writers).name
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_a_failing_writer_leaves_the_previous_checkpoint_and_every_rank_raises(world, tmp_path) -> None:
    names = world(4).run(_save_with_limit, str(tmp_path), 0, 4, None)
    assert set(names) == {"model.safetensors.index.json"}
    before = _snapshot(tmp_path)
    with pytest.raises(RemoteError) as info:
        world(4).run(_save_with_limit, str(tmp_path), 1, 4, 2, timeout=60)
    per_rank = info.value.per_rank
    assert per_rank is not None and len(per_rank) == 4
    for rank, r in enumerate(per_rank):
        assert isinstance(r, RemoteError) and r.exc_type == "OSError", per_rank
        assert "File too large" in r.message, r.message
        named = r.remote_traceback if rank == 2 else r.message  # the writer itself: its own error, noted
        assert ("raised on rank 2" if rank == 2 else "(on rank 2)") in named, named
    assert _snapshot(tmp_path) == before  # nothing new, nothing lost, no temporary file


def _save_killed_writer(dst: str, seed: int) -> tuple[str, str, float]:
    """writers=4; rank 2's process dies at its first file write (a writer killed mid-save)."""
    import os
    import time

    from fsdptk import save_safetensors
    from fsdptk._files import safetensors_writer

    model = _linear_stack(seed)
    if dist.get_rank() == 2:
        def die(self, key, tensor):  # noqa: ANN001, ANN202 - the writer's own signature
            os._exit(3)

        safetensors_writer.ShardFiles.write = die  # this process ends in it: nothing to restore
    start = time.monotonic()
    try:
        save_safetensors(model, dst, writers=4)
    except Exception as e:  # noqa: BLE001 - compared by the test
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_a_killed_writer_makes_every_rank_raise_and_leaves_the_previous_checkpoint(world, tmp_path) -> None:
    w = world(4)
    w.run(_save_with_limit, str(tmp_path), 0, 4, None)
    before = _snapshot(tmp_path)
    res = w.run(_save_killed_writer, str(tmp_path), 1, timeout=60, return_exceptions=True)
    assert isinstance(res[2], RemoteError) and res[2].exc_type == "WorkerDied", res[2]
    for rank in (0, 1, 3):
        kind, message, seconds = res[rank]
        assert kind != "no error" and "rank 2" in message, res[rank]
        assert seconds < 10, res[rank]  # within seconds, not a collective timeout
    assert _snapshot(tmp_path) == before  # the previous checkpoint, complete; no temporary file
    assert w.run(_save_with_limit, str(tmp_path), 2, 4, None) == ["model.safetensors.index.json"] * 4


def _bad_writers(dst: str, writers: object) -> None:
    from fsdptk import save_safetensors

    save_safetensors(_linear_stack(0), dst, writers=writers)


@pytest.mark.parametrize(("writers", "exc_type", "needle"), [
    (0, "ValueError", "got 0"), (3, "ValueError", "got 3"), (2.0, "TypeError", "got 2.0"),
    ("hosts", "TypeError", "got 'hosts'")])
def test_bad_writers_raise_on_every_rank_before_anything_is_written(world, tmp_path, writers, exc_type,
                                                                     needle) -> None:
    dst = tmp_path / "ckpt"
    with pytest.raises(RemoteError) as info:
        world(2).run(_bad_writers, str(dst), writers, timeout=60)
    for r in info.value.per_rank or []:
        assert isinstance(r, RemoteError) and r.exc_type == exc_type and needle in r.message, r
    assert not dst.exists()


# ----------------------------------------------------------------------------------------------
# the background save; one writer per host
def _async_and_host(root: str) -> tuple[list[str], int]:
    from fsdptk import save_safetensors, save_safetensors_async
    from fsdptk._files.writers import writer_ranks

    model = _linear_stack(3)
    save_safetensors(model, f"{root}/w1")
    pending = save_safetensors_async(model, f"{root}/w4", writers=4)
    with torch.no_grad():  # training goes on: the files hold the snapshot
        for p in model.parameters():
            p.add_(1.0)
    pending.wait()
    return [str(r) for r in writer_ranks("host")], len(writer_ranks(2))


def test_background_save_with_writers_and_one_writer_per_host(world, tmp_path) -> None:
    results = world(4).run(_async_and_host, str(tmp_path))
    _assert_same(_tensors(tmp_path / "w4"), _tensors(tmp_path / "w1"))
    assert len(list((tmp_path / "w4").glob("*.safetensors"))) >= 16
    for hosts, two in results:
        assert hosts == ["0"]  # one machine, one network namespace: one host, rank 0 writes
        assert two == 2
