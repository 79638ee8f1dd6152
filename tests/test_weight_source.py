"""``fsdptk.hf.weight_source`` (issue 41): the model's weights as vLLM's ``WeightSource`` in the Hub
layout, each full tensor gathered to its owner only.

On real gloo ranks, for a tiny Llama and a tiny Qwen3-MoE loaded with ``fsdptk.hf.from_pretrained``
under FSDP (2 and 4 ranks), FSDP x TP, HSDP and EP: the union of every owner's ``iter_full`` is
``save_pretrained``'s tensors, name for name, bit for bit (per-expert tensors for the fused
experts); each rank's ``iter_full`` is exactly its ``owned_names``; the metadata is the same on
every rank; the ``iter_local`` pieces put together by their placements are the full tensors;
``iter_buckets`` is ``iter_full`` regrouped within ``bucket_bytes``. A consumer on the owners that
sleeps and sends each tensor on a second process group between buckets hangs nothing; a
``.throw`` on one owner raises on every rank; ranks that disagree on an argument are named; a second
pass reads the current weights; PEFT adapters alone and merged equal PEFT's own. Quantized
(``quantize="fp8"``, ``"fp8-ue8m0"``, ``"mxfp4"``): the owners' tensors together are what
``save_safetensors(quantize=...)`` writes for the same model, bit for bit, with its
``quantization_config``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from _tiny_hub import tensors as _tensors  # noqa: E402

MESHES = {"fsdp2": (2, {"dp_shard": 2}), "fsdp4": (4, {"dp_shard": 4}), "tp": (4, {"dp_shard": 2, "tp": 2}),
          "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2}), "ep": (4, {"dp_shard": 4, "ep": 2}),
          "tp_ep": (4, {"dp_shard": 2, "tp": 2, "ep": 2})}


# ----------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
def _meta_rows(source) -> list[tuple]:
    return [(m.name, str(m.dtype), tuple(m.shape), tuple(m.owners), tuple(m.mesh_shape),
             None if m.placements is None else tuple(repr(p) for p in m.placements)) for m in source.metadata]


def _stream(src: str, dims_kw: dict, owners, dtype: str | None, bucket_bytes: int) -> dict:
    """Every view of one source on this rank: metadata, owned names, iter_full, iter_local,
    iter_buckets."""
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(**dims_kw))
    source = weight_source(model, owners=owners, dtype=getattr(torch, dtype) if dtype else None,
                           bucket_bytes=bucket_bytes)
    world = dist.get_world_size()
    full = list(source.iter_full())
    local = list(source.iter_local())
    buckets = [[(n, t.clone()) for n, t in b] for b in source.iter_buckets()]
    return {"meta": _meta_rows(source), "owned": [source.owned_names(r) for r in range(world)],
            "full": full, "local": [(n, t.clone()) for n, t in local], "buckets": buckets}


def _expected_piece(full: torch.Tensor, meta: tuple, cell: int) -> torch.Tensor:
    """The piece of ``full`` at row-major ``cell`` of the record's mesh, as its placements say
    (``Shard(d)`` splitting like ``torch.chunk``, the outer mesh axis first; none: whole)."""
    _, _, _, _, mesh_shape, placements = meta
    if placements is None:
        return full
    coords = []
    for n in reversed(mesh_shape):
        coords.append(cell % n)
        cell //= n
    coords.reverse()
    piece = full
    for size, at, p in zip(mesh_shape, coords, placements):
        if p.startswith("Shard"):
            d = int(p.split("=")[1].rstrip(")"))
            chunks = torch.chunk(piece, size, dim=d)
            piece = chunks[at] if at < len(chunks) else piece.narrow(d, 0, 0)
    return piece


def _check_source(results: list[dict], ref: dict[str, torch.Tensor], bucket_bytes: int) -> dict[str, int]:
    """Everything the source promises, against the reference tensors; how many Hub tensors had each
    placement (so a test can tell the local split was exercised)."""
    meta = results[0]["meta"]
    assert all(r["meta"] == meta for r in results), "the metadata differs between ranks"
    owned = results[0]["owned"]
    assert all(r["owned"] == owned for r in results)
    names = [m[0] for m in meta]
    assert sorted(names) == sorted(ref), (sorted(set(names) ^ set(ref)))
    by_meta = {m[0]: m for m in meta}
    assert sorted({n for o in owned for n in o}) == sorted(names), "a name no rank owns"
    union: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(results):
        assert owned[rank] == [m[0] for m in meta if rank in m[3]], "owned_names is not vLLM's definition"
        got = [n for n, _ in r["full"]]
        assert got == owned[rank], f"rank {rank} iter_full yields {got[:4]}..., owns {owned[rank][:4]}..."
        union.update(r["full"])
        for name, t in r["full"]:
            assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), (rank, name)
        flat = [(n, t) for b in r["buckets"] for n, t in b]
        assert [n for n, _ in flat] == got
        assert all(torch.equal(t, dict(r["full"])[n]) for n, t in flat)
        for b in r["buckets"]:
            assert len(b) <= 1 or sum(t.numel() * t.element_size() for _, t in b) <= bucket_bytes
        assert [n for n, _ in r["local"]] == owned[rank], "iter_local yields what the rank owns, in order"
        for name, piece in r["local"]:
            m = by_meta[name]
            assert torch.equal(piece, _expected_piece(ref[name], m, m[3].index(rank))), (name, rank, m)
    assert sorted(union) == sorted(ref)
    kinds: dict[str, int] = {}
    for m in meta:
        kind = "whole" if m[5] is None else "+".join(m[5])
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


@pytest.fixture(scope="module")
def llama(hub) -> Path:
    return hub("llama")


# ----------------------------------------------------------------------------------------------
# the Hub layout, bit for bit, on every mesh
CASES = [("llama", "fsdp2", 1, None), ("llama", "fsdp4", 4, None), ("llama", "fsdp4", "all", None),
         ("llama", "tp", 1, "bfloat16"), ("llama", "tp", "all", None), ("llama", "hsdp", 2, None),
         ("llama", "hsdp", "all", "bfloat16"), ("qwen3_moe", "fsdp4", 1, None), ("qwen3_moe", "tp", 4, None),
         ("qwen3_moe", "tp", "all", None), ("qwen3_moe", "hsdp", "host", None), ("qwen3_moe", "ep", 4, None),
         ("qwen3_moe", "ep", 1, "bfloat16"), ("qwen3_moe", "ep", "all", None), ("mixtral", "ep", 4, None),
         ("mixtral", "tp", 1, None), ("deepseek_v3", "fsdp4", 2, None), ("deepseek_v3", "ep", 1, None),
         ("gpt_oss", "fsdp2", 2, None), ("gpt_oss", "tp", 4, "bfloat16"), ("qwen3_moe", "fsdp2", 1, None),
         ("qwen3_moe", "tp_ep", "all", None), ("mixtral", "tp_ep", 4, None), ("deepseek_v3", "hsdp", "all", None)]


@pytest.mark.parametrize(("family", "mesh", "owners", "dtype"), CASES,
                         ids=[f"{f}-{m}-owners{o}-{d or 'model'}" for f, m, o, d in CASES])
def test_union_of_owners_is_the_hub_checkpoint(world, hub, family, mesh, owners, dtype) -> None:
    src = hub(family)
    n, dims_kw = MESHES[mesh]
    bucket_bytes = 20_000
    results = world(n).run(_stream, str(src), dims_kw, owners, dtype, bucket_bytes, timeout=240)
    ref = {k: t.to(getattr(torch, dtype)) if dtype else t for k, t in _tensors(src).items()}
    kinds = _check_source(results, ref, bucket_bytes)
    meta = results[0]["meta"]
    if owners == "all":  # every rank owns every name, in rank order (vLLM's M2N engine)
        assert all(m[3] == tuple(range(n)) for m in meta)
    else:  # one owner per name: rank 0 (owners=1), W ranks spread over the world, one per host
        writers = [0] if owners == "host" else [w * n // owners for w in range(owners)]
        assert all(len(m[3]) == 1 and m[5] is None for m in meta)
        assert sorted({m[3][0] for m in meta}) == writers
    if owners == "all" and mesh == "fsdp4" and family == "llama":  # FSDP's Shard(0): pieces held
        assert kinds.get("Shard(dim=0)", 0) >= len(ref) // 2, kinds
    if owners == "all" and mesh == "hsdp":
        assert kinds.get("Replicate()+Shard(dim=0)", 0) >= len(ref) // 2, kinds
    if owners == "all" and mesh == "tp":  # FSDP's Shard(0) over dp of the tensors TP leaves whole
        # (norms) are pieces on the dp x tp world; row-wise TP x FSDP shards both axes, which vLLM's
        # M2N engine cannot take: whole
        assert kinds.get("Shard(dim=0)+Replicate()", 0) >= 4, kinds
        assert not any(k.count("Shard") > 1 for k in kinds), kinds
    if family in ("qwen3_moe", "mixtral", "deepseek_v3"):
        assert any(".experts.7." in k for k in ref)  # the Hub's per-expert tensors (gpt-oss ships fused ones)


def _m2n_layouts(src: str, dims_kw: dict) -> list[str]:
    """owners='all' records through vLLM's own M2N planning (m2n_param_meta, its placement check):
    the layout of each record as M2N takes it."""
    from vllm.distributed.weight_transfer.m2n_common import REPLICATED, check_placements, m2n_param_meta

    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(**dims_kw))
    out = []
    for meta in weight_source(model, owners="all").metadata:
        layout = m2n_param_meta(meta, dist.get_world_size()).source_layout
        if layout.placements is not REPLICATED:
            check_placements(layout.placements, meta.name)
        out.append(f"{layout.mesh.dims} {layout.placements}")
    return out


@pytest.mark.parametrize(("family", "mesh"), [("llama", "fsdp4"), ("llama", "tp"), ("llama", "hsdp"),
                                              ("qwen3_moe", "ep")])
def test_owners_all_is_what_vllms_m2n_engine_takes(world, hub, family, mesh) -> None:
    pytest.importorskip("vllm.distributed.weight_transfer.m2n_common")
    n, dims_kw = MESHES[mesh]
    layouts = world(n).run(_m2n_layouts, str(hub(family)), dims_kw, timeout=180)[0]
    assert any("None" not in layout for layout in layouts), layouts  # some pieces served in place


def _nf4(owners) -> dict:
    """A QLoRA-like module (an NF4 base weight, plain bias) sharded with FSDP: what the source gives."""
    from torch import nn

    from fsdptk import shard_model
    from fsdptk.hf import weight_source
    from fsdptk.nf4 import dequantize, to_nf4

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    want = {"0.weight": dequantize(to_nf4(model[0].weight.detach().clone(), 64, 8)),
            "0.bias": model[0].bias.detach().clone()}
    model[0].weight = nn.Parameter(to_nf4(model[0].weight.detach(), 64, 8), requires_grad=False)
    shard_model(model, [lambda name, module: name == "0"], cpu_offload=False)
    source = weight_source(model, owners=owners)
    return {"want": want, "full": dict(source.iter_full()), "local": dict(source.iter_local()),
            "meta": _meta_rows(source)}


@pytest.mark.parametrize("owners", [1, "all"])
def test_nf4_weights_are_dequantized(world, owners) -> None:
    results = world(2).run(_nf4, owners, timeout=120)
    want = results[0]["want"]
    got: dict[str, torch.Tensor] = {}
    for r in results:
        got.update(r["full"])
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    meta = {m[0]: m for m in results[0]["meta"]}
    assert meta["0.weight"][5] is None  # an NF4 shard is no plain piece: whole, dequantized
    for rank, r in enumerate(results):
        for name, piece in r["local"].items():
            assert torch.equal(piece, _expected_piece(want[name], meta[name], meta[name][3].index(rank)))


# ----------------------------------------------------------------------------------------------
# quantized on the way out (issue 42): the release save_safetensors(quantize=...) writes, streamed
def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (float8 has no ``torch.equal`` on CPU; -0.0 and NaN payloads count)."""
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _pack(pairs) -> list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]]:
    """``(name, tensor)`` pairs as their bytes, for the way back from a worker (float8 tensors do
    not unpickle in torch 2.13); :func:`_unpack` restores them."""
    return [(n, t.dtype, tuple(t.shape), _bits(t).flatten().clone()) for n, t in pairs]


def _unpack(packed) -> list[tuple[str, torch.Tensor]]:
    return [(n, raw.view(dtype).reshape(shape)) for n, dtype, shape, raw in packed]


def _quantized(src: str, dims_kw: dict, quantize: str, block, dtype: str | None, out: str) -> dict:
    """The same sharded model saved with ``save_safetensors(conversion="auto", quantize=...)`` to
    ``out``, and streamed by ``weight_source(quantize=...)`` with owners 1, 2 and 'all'."""
    from fsdptk import ParallelDims, save_safetensors
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(**dims_kw))
    kw: dict = {} if block is None else {"block_size": block}
    if dtype is not None:  # quantized from the cast tensor, on both sides
        kw["dtype"] = getattr(torch, dtype)
    save_safetensors(model, out, conversion="auto", quantize=quantize, **kw)
    world = dist.get_world_size()
    got = {}
    for owners in (1, 2, "all"):
        source = weight_source(model, owners=owners, quantize=quantize, bucket_bytes=20_000, **kw)
        got[owners] = {"meta": _meta_rows(source), "owned": [source.owned_names(r) for r in range(world)],
                       "full": _pack(source.iter_full()), "local": _pack(source.iter_local()),
                       "config": source.quantization_config}
    return got


def _check_quantized(results: list[dict], ref: dict[str, torch.Tensor], config: dict, owners) -> None:
    """Every owner's iter_full together is the saved release, name for name and bit for bit (dtype
    included); each rank yields exactly its owned names; quantized tensors are never local pieces."""
    n = len(results)
    runs = [{**r[owners], "full": _unpack(r[owners]["full"]), "local": _unpack(r[owners]["local"])} for r in results]
    meta = runs[0]["meta"]
    assert all(r["meta"] == meta for r in runs), "the metadata differs between ranks"
    assert all(r["config"] == config for r in runs), (runs[0]["config"], config)
    assert [m[0] for m in meta] == list(dict.fromkeys(m[0] for m in meta)) and sorted(m[0] for m in meta) == sorted(ref)
    by_meta = {m[0]: m for m in meta}
    union: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(runs):
        assert r["owned"] == runs[0]["owned"]
        assert [name for name, _ in r["full"]] == r["owned"][rank] == [m[0] for m in meta if rank in m[3]]
        for name, t in r["full"]:
            assert str(t.dtype) == by_meta[name][1] and tuple(t.shape) == by_meta[name][2], name
            assert _same(t, ref[name]), (rank, name, t.dtype, ref[name].dtype)
            union[name] = t
        assert [name for name, _ in r["local"]] == r["owned"][rank]
        for name, piece in r["local"]:
            m = by_meta[name]
            assert _same(piece, _expected_piece(ref[name], m, m[3].index(rank))), (rank, name)
    assert sorted(union) == sorted(ref)
    if owners == "all":
        assert all(m[3] == tuple(range(n)) for m in meta)
        written = [m for m in meta if ref[m[0]].dtype in (torch.float8_e4m3fn, torch.uint8)
                   or m[0].endswith(("_scale_inv", "_scales", "_blocks"))]
        assert written and all(m[5] is None for m in written), [m for m in written if m[5] is not None][:2]
        assert any(m[5] is not None for m in meta), "no unquantized tensor served as a local piece"
    else:
        writers = [w * n // owners for w in range(owners)]
        assert all(len(m[3]) == 1 and m[5] is None for m in meta)
        assert sorted({m[3][0] for m in meta}) == writers


QUANT_CASES = [(family, mesh, quantize, block, None) for family in ("llama", "qwen3_moe") for mesh in ("fsdp2", "tp")
               for quantize, block in (("fp8", None), ("fp8-ue8m0", (32, 48)))] + [
    ("llama", "fsdp2", "fp8", None, "bfloat16"), ("gpt_oss", "fsdp2", "mxfp4", None, None)]


@pytest.mark.parametrize(("family", "mesh", "quantize", "block", "dtype"), QUANT_CASES,
                         ids=[f"{f}-{m}-{q}-{b or 'default'}-{d or 'model'}" for f, m, q, b, d in QUANT_CASES])
def test_quantize_streams_exactly_the_quantized_save(world, hub, tmp_path, family, mesh, quantize, block,
                                                     dtype) -> None:
    """``weight_source(quantize=...)`` at 2 ranks (FSDP) and 4 (FSDP x TP), owners 1, 2 and 'all':
    the union of the owners' tensors is what ``save_safetensors(conversion="auto", quantize=...)``
    writes for the same model (e4m3 weights with float32 scales, ue8m0 scales on a rounded-up grid,
    gpt-oss's MXFP4 blocks and scales; with ``dtype``: quantized from the cast tensors), bit for
    bit, and ``quantization_config`` is its config.json's."""
    import json

    n, dims_kw = MESHES[mesh]
    out = tmp_path / "release"
    results = world(n).run(_quantized, str(hub(family)), dims_kw, quantize, block, dtype, str(out), timeout=240)
    ref = _tensors(out)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    dtypes = {t.dtype for t in ref.values()}
    if quantize == "mxfp4":
        assert config["quant_method"] == "mxfp4" and torch.uint8 in dtypes
        assert any(k.endswith("experts.gate_up_proj_blocks") for k in ref)
    else:
        assert config["quant_method"] == "fp8" and torch.float8_e4m3fn in dtypes
        assert config["weight_block_size"] == list(block or (128, 128))
        assert config.get("scale_fmt") == ("ue8m0" if quantize == "fp8-ue8m0" else None)
        assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in ref
        if family == "qwen3_moe":  # the fused experts, quantized per expert in the Hub layout
            assert ref["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == torch.float8_e4m3fn
    if dtype is not None:
        assert ref["model.norm.weight"].dtype == getattr(torch, dtype)
    for owners in (1, 2, "all"):
        _check_quantized(results, ref, config, owners)


# ----------------------------------------------------------------------------------------------
# lazy consumers: an owner that sleeps and sends on another group while the others run ahead
def _lazy(src: str, owners) -> dict[str, torch.Tensor]:
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(dp_shard=4))
    source = weight_source(model, owners=owners, bucket_bytes=8_000)
    world, rank = dist.get_world_size(), dist.get_rank()
    side = dist.new_group(backend="gloo")  # the "inference engine's" group
    meta = {m.name: m for m in source.metadata}
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    received: dict[str, torch.Tensor] = {}

    def receive() -> None:  # the engine's side of rank prev's stream
        for name in source.owned_names(prev):
            t = torch.empty(meta[name].shape, dtype=meta[name].dtype)
            dist.recv(t, src=prev, group=side)
            received[name] = t

    thread = threading.Thread(target=receive)
    thread.start()
    buckets = 0
    for bucket in source.iter_buckets():
        if bucket:
            buckets += 1
            time.sleep(0.02)
            for _, t in bucket:
                dist.send(t, dst=nxt, group=side)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert not source.owned_names(rank) or buckets > 3  # several buckets: the others ran ahead
    dist.barrier(group=side)
    dist.destroy_process_group(side)
    return received


@pytest.mark.parametrize("owners", [1, 4])
def test_lazy_owner_sending_on_another_group_never_hangs(world, llama, owners) -> None:
    results = world(4).run(_lazy, str(llama), owners, timeout=120)
    got: dict[str, torch.Tensor] = {}
    for r in results:
        got.update(r)
    ref = _tensors(llama)
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


# ----------------------------------------------------------------------------------------------
# memory: beyond its shards, a rank holds about two buckets (measured: the peak RSS of a pass)
def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _peaks(src: str, owners, bucket_bytes: int) -> dict[str, tuple[int, int]]:
    """Per pass: (peak RSS above the RSS before it, bytes this rank was handed). Blocks of 128 KiB
    and more are mmapped and returned when freed (glibc's mallopt), so RSS follows live memory; the
    peak is reset before each pass (``/proc/self/clear_refs``). A first pass pages the shards in
    (the load keeps them as copy-on-write views of the file) and is not measured."""
    import ctypes
    import gc

    from fsdptk import ParallelDims, gather_cpu_state_dict
    from fsdptk.hf import from_pretrained, weight_source

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    model = from_pretrained(src, dims=ParallelDims(dp_shard=4))
    source = weight_source(model, owners=owners, bucket_bytes=bucket_bytes)
    out = {}
    for what in ("warm-up", "source", "gather_cpu_state_dict"):
        gc.collect()
        libc.malloc_trim(0)
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS
        before = _status_bytes("VmRSS")
        handed = 0
        if what == "gather_cpu_state_dict":  # the whole model on rank 0: the measurement sees it
            sd = gather_cpu_state_dict(model, dist.get_rank() == 0)
            handed = sum(t.numel() * t.element_size() for t in sd.values())
            del sd
        else:
            for bucket in source.iter_buckets():
                handed += sum(t.numel() * t.element_size() for _, t in bucket)
                del bucket
        out[what] = (_status_bytes("VmHWM") - before, handed)
    return out


@pytest.mark.parametrize("owners", [1, 4])
def test_memory_beyond_the_shards_is_about_two_buckets(world, tmp_path, owners) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                      tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ref = _tensors(tmp_path)
    total = sum(t.numel() * t.element_size() for t in ref.values())
    largest = max(t.numel() * t.element_size() for t in ref.values())  # 4 MiB (embeddings, lm_head)
    bucket_bytes = 2**20
    results = world(4).run(_peaks, str(tmp_path), owners, bucket_bytes, timeout=180)
    assert sum(r["source"][1] for r in results) == total
    assert results[0]["gather_cpu_state_dict"][0] >= total  # the whole model on rank 0, seen
    bound = 2 * max(bucket_bytes, largest) + 2 * 2**20
    for rank, r in enumerate(results):
        peak, handed = r["source"]
        assert peak <= bound, (rank, peak, bound, handed)
    if owners == 1:  # rank 0 receives the whole model, at most about two buckets of it at once
        assert results[0]["source"][1] == total and results[0]["source"][0] <= total / 4


# ----------------------------------------------------------------------------------------------
# failures: a consumer's error on one owner, bad and disagreeing arguments; a fresh second pass
def _throw_then_again(src: str, owners, mesh: str, mode: str) -> dict:
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(**MESHES[mesh][1]))
    source = weight_source(model, owners=owners, bucket_bytes=8_000)
    rank = dist.get_rank()
    thrower = 0 if owners == 1 else 3
    outcome = None
    it = source.iter_full() if mode == "full" else source.iter_local()
    try:
        for i, _ in enumerate(it):
            if rank == thrower and i == 2:
                it.throw(ConnectionError("the engine's send failed"))
    except Exception as e:  # noqa: BLE001 - what every rank raised
        outcome = (type(e).__name__, str(e))
    with torch.no_grad():  # the next pass reads the current weights
        for p in model.parameters():
            p.mul_(2)
    second = dict(source.iter_full())
    return {"outcome": outcome, "second": second}


@pytest.mark.parametrize(("owners", "mesh", "mode"), [(1, "fsdp4", "full"), (4, "fsdp4", "full"),
                                                     ("all", "tp", "local"), ("all", "fsdp4", "local")])
def test_throw_on_one_owner_raises_on_every_rank_and_a_new_pass_reads_current_weights(world, llama, owners, mesh,
                                                                                      mode):
    """iter_full, and iter_local with owners='all': its pieces interleaved with gathered tensors
    (FSDP x TP), or all of them local (FSDP: agreed once more after the last piece)."""
    results = world(4).run(_throw_then_again, str(llama), owners, mesh, mode, timeout=120)
    for r in results:
        assert r["outcome"] is not None and r["outcome"][0] == "ConnectionError", r["outcome"]
        assert "the engine's send failed" in r["outcome"][1]
    second: dict[str, torch.Tensor] = {}
    for r in results:
        second.update(r["second"])
    ref = _tensors(llama)
    assert sorted(second) == sorted(ref)
    assert all(torch.equal(second[k], ref[k] * 2) for k in ref)


def _bad(src: str, case: str) -> tuple[str, str]:
    from fsdptk import ParallelDims
    from fsdptk.hf import from_pretrained, weight_source

    model = from_pretrained(src, dims=ParallelDims(dp_shard=4))
    rank = dist.get_rank()
    kw: dict = {}
    if case == "dtype":
        kw = {"dtype": torch.bfloat16} if rank == 1 else {}
    elif case == "owners_and_bucket":
        kw = {"owners": 2 if rank == 3 else 1, "bucket_bytes": 1024 if rank == 2 else None}
    elif case == "owners_range":
        kw = {"owners": 7} if rank == 2 else {}
    elif case == "adapters":
        kw = {"adapters": "merged"}  # no PEFT adapter
    elif case == "quantize":
        kw = {"quantize": "fp8"} if rank == 0 else {}
    elif case == "quantize_value":
        kw = {"quantize": "int8" if rank == 2 else "fp8"}
    elif case == "block_size":
        kw = {"quantize": "fp8", "block_size": (64, 64) if rank == 3 else (128, 128)}
    elif case == "mxfp4_dense":
        kw = {"quantize": "mxfp4"}  # a Llama has no gpt-oss experts
    try:
        weight_source(model, **kw)
    except Exception as e:  # noqa: BLE001 - what every rank raised
        return type(e).__name__, str(e)
    return "none", ""


@pytest.mark.parametrize(("case", "kind", "needles"), [
    ("dtype", "ValueError", ["weight_source: the ranks disagree on dtype: ranks 0, 2, 3 passed None, "
                             "rank 1 passed torch.bfloat16"]),
    ("owners_and_bucket", "ValueError", ["on owners: ranks 0-2 passed 1, rank 3 passed 2",
                                         "on bucket_bytes: ranks 0, 1, 3 passed None, rank 2 passed 1024"]),
    ("owners_range", "ValueError", ["owners must be between 1 and the world size (4), 'host' or 'all'", "got 7"]),
    ("adapters", "TypeError", ["adapters is for PEFT models: FSDPLlamaForCausalLM has no PEFT adapter"]),
    ("quantize", "ValueError", ["weight_source: the ranks disagree on quantize: rank 0 passed 'fp8', ranks 1-3 "
                                "passed None"]),
    ("quantize_value", "ValueError", ["quantize must be None, 'fp8', 'fp8-ue8m0' or 'mxfp4', got 'int8'"]),
    ("block_size", "ValueError", ["the ranks disagree on block_size: ranks 0-2 passed [128, 128], rank 3 passed "
                                  "[64, 64]"]),
    ("mxfp4_dense", "ValueError", ["quantize='mxfp4' writes gpt-oss's MXFP4 experts", "FSDPLlamaForCausalLM has none"]),
])
def test_bad_or_disagreeing_arguments_are_named_on_every_rank(world, llama, case, kind, needles) -> None:
    results = world(4).run(_bad, str(llama), case, timeout=120)
    for got_kind, message in results:
        assert got_kind == kind, (case, results)
        for needle in needles:
            assert needle in message, (needle, message)


# ----------------------------------------------------------------------------------------------
# PEFT: the adapter alone (PEFT's names) and merged into the base (merge_and_unload's names)
def _peft_stream(src: str, adapters: str, owners, out: str) -> dict:
    """A LoRA model sharded with FSDP: the source's tensors, and PEFT's own (the adapter state dict,
    or ``save_pretrained`` of ``merge_and_unload()``, read back) from the same unsharded model."""
    import copy

    import peft

    from fsdptk import shard_model
    from fsdptk.hf import no_split_modules, weight_source

    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    if adapters == "only":
        want = {k: t.detach().clone() for k, t in peft.utils.get_peft_model_state_dict(model).items()}
    else:
        merged_dir = Path(out) / f"merged{dist.get_rank()}"
        copy.deepcopy(model).merge_and_unload().save_pretrained(merged_dir)
        want = _tensors(merged_dir)
    shard_model(model, no_split_modules(model), cpu_offload=False)
    source = weight_source(model, adapters=adapters, owners=owners)
    return {"want": want, "full": dict(source.iter_full()), "meta": _meta_rows(source),
            "local": [(n, t.clone()) for n, t in source.iter_local()]}


@pytest.mark.parametrize(("family", "adapters", "owners"), [("llama", "only", "all"), ("llama", "merged", 2),
                                                           ("qwen3_moe", "merged", 1)])
def test_peft_adapters_only_and_merged_equal_peft_own(world, hub, tmp_path, family, adapters, owners) -> None:
    src = hub(family)
    results = world(2).run(_peft_stream, str(src), adapters, owners, str(tmp_path), timeout=180)
    want = results[0]["want"]
    got: dict[str, torch.Tensor] = {}
    for r in results:
        got.update(r["full"])
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    if adapters == "only":
        assert all("lora_" in k for k in got)
    else:  # the base's Hub names (per-expert tensors for Qwen3-MoE), LoRA merged into q and v only
        ref = _tensors(src)
        assert sorted(got) == sorted(ref)
        changed = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert changed and all("q_proj" in k or "v_proj" in k for k in changed)
    meta = {m[0]: m for m in results[0]["meta"]}
    for name, m in meta.items():
        for cell, rank in enumerate(m[3]):
            piece = dict(results[rank]["local"])[name]
            assert torch.equal(piece, _expected_piece(want[name], m, cell)), name
    if owners == "all":  # FSDP's Shard(0) of the LoRA factors: pieces served where they are
        assert sum(m[5] == ("Shard(dim=0)",) for m in meta.values()) >= len(meta) // 2


@pytest.mark.parametrize(("config", "needle"), [
    ({"use_dora": True}, "'base_model.model.model.layers.0.self_attn.q_proj': it uses DoRA"),
    ({"lora_bias": True}, "it has a LoRA bias"),
])
def test_merged_refuses_what_is_not_plain_lora_naming_the_layer(llama, config, needle) -> None:
    peft = pytest.importorskip("peft")
    from fsdptk.hf import weight_source

    base = transformers.AutoModelForCausalLM.from_pretrained(llama)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], **config))
    with pytest.raises(NotImplementedError, match="adapters='merged'") as info:
        weight_source(model, adapters="merged")
    assert needle in str(info.value) and "adapters='only'" in str(info.value)
    assert sorted(dict(weight_source(model, adapters="only").iter_full())) == sorted(
        peft.utils.get_peft_model_state_dict(model))


# LoRA on the fused experts (PEFT's ParamWrapper, target_parameters) merged: merge_and_unload's experts
# in the Hub layout (per-expert tensors)
_EXPERT_LORA = {"qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                "mixtral": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def _expert_lora_stream(src: str, family: str, dims_kw: dict, out: str) -> dict:
    """A Hub model with LoRA on q_proj and on both experts parameters (nested ParamWrappers), sharded
    with FSDP / HSDP: on rank 0 PEFT's own ``merge_and_unload().save_pretrained`` read back (the
    judge, from the same unsharded model, in this process); on every rank what the merged source
    yields for owners 1, W and "all" (iter_full, and iter_local's pieces)."""
    import copy

    import peft

    from fsdptk import ParallelDims, shard_model
    from fsdptk.hf import no_split_modules, weight_source

    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                       target_parameters=_EXPERT_LORA[family],
                                                       init_lora_weights=False))
    want: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        merged_dir = Path(out) / "merged"
        copy.deepcopy(model).merge_and_unload().save_pretrained(merged_dir)
        want = _tensors(merged_dir)
    dims = ParallelDims(**dims_kw)
    dims.build_mesh("cpu")
    experts = []
    if dims.ep > 1:  # expert parallel: each rank's experts and their LoRA blocks (issue 43)
        from fsdptk import apply_ep
        from fsdptk.hf import hf_ep_plan

        experts = hf_ep_plan(model)
        apply_ep(model, dims.ep_mesh, experts)
    shard_model(model, no_split_modules(model), cpu_offload=False, dp_mesh=dims.fsdp_mesh,
                expert_dp_mesh=dims.expert_fsdp_mesh if experts else None)
    got: dict = {"want": want}
    for owners in (1, dist.get_world_size(), "all"):
        source = weight_source(model, adapters="merged", owners=owners)
        got[owners] = {"full": dict(source.iter_full()), "meta": _meta_rows(source),
                       "local": {n: t.clone() for n, t in source.iter_local()}}
    return got


@pytest.mark.parametrize(("family", "mesh"), [("qwen3_moe", "fsdp2"), ("mixtral", "hsdp"), ("qwen3_moe", "ep")])
def test_merged_lora_on_the_experts_is_merge_and_unloads_hub_checkpoint(world, hub, tmp_path, family,
                                                                        mesh) -> None:
    """The union of every owner's ``iter_full`` is ``save_pretrained`` of PEFT's ``merge_and_unload()``
    (per-expert Hub tensors), name for name and bit for bit, for owners 1, W and "all"; with "all"
    each rank's ``iter_local`` pieces are the merged tensors cut as their records say."""
    src = hub(family)
    n, dims_kw = MESHES[mesh]
    results = world(n).run(_expert_lora_stream, str(src), family, dims_kw, str(tmp_path), timeout=240)
    want = results[0]["want"]
    ref = _tensors(src)
    assert sorted(want) == sorted(ref)
    changed = {k for k in ref if not torch.equal(ref[k], want[k])}
    experts = {k for k in ref if ".experts." in k}
    assert len(experts) == 2 * 8 * 3 and experts <= changed  # every expert's gate, up and down merged
    assert all(k in experts or "q_proj" in k for k in changed)
    for owners in (1, n, "all"):
        got: dict[str, torch.Tensor] = {}
        for rank, r in enumerate(results):
            mine = r[owners]["full"]
            if owners == "all":
                assert sorted(mine) == sorted(want), rank
            got.update(mine)
        assert sorted(got) == sorted(want), owners
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), (owners, k)
        for m in results[0][owners]["meta"]:
            for cell, rank in enumerate(m[3]):
                assert torch.equal(results[rank][owners]["local"][m[0]], _expected_piece(want[m[0]], m, cell)), m


def test_merged_bf16_base_with_fp32_adapters_is_peft_own_bit_for_bit(hub, tmp_path) -> None:
    """One process: a bf16 Qwen3-MoE whose LoRA factors PEFT keeps in float32 (its default
    ``autocast_adapter_dtype``), on q_proj (lora.Linear: the float32 delta added in place to the bf16
    weight) and on the experts (ParamWrapper: the delta cast to bf16, then added): the merged source
    is ``save_pretrained`` of ``merge_and_unload()``, bit for bit, in bf16."""
    import copy

    peft = pytest.importorskip("peft")
    from fsdptk.hf import weight_source

    base = transformers.AutoModelForCausalLM.from_pretrained(hub("qwen3_moe"), dtype=torch.bfloat16)
    torch.manual_seed(2)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                      target_parameters=_EXPERT_LORA["qwen3_moe"],
                                                      init_lora_weights=False))
    factors = {t.dtype for k, t in model.state_dict().items() if "lora_" in k}
    assert factors == {torch.float32}
    copy.deepcopy(model).merge_and_unload().save_pretrained(tmp_path)
    want = _tensors(tmp_path)
    got = dict(weight_source(model, adapters="merged").iter_full())
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert t.dtype == torch.bfloat16 and got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_merged_refuses_lora_on_experts_already_merged_naming_the_wrapper(hub) -> None:
    """One process: a ParamWrapper whose adapter is merged already (``merge_adapter()``) is refused by
    name; ``adapters="only"`` still streams the adapter."""
    peft = pytest.importorskip("peft")
    from fsdptk.hf import weight_source

    base = transformers.AutoModelForCausalLM.from_pretrained(hub("qwen3_moe"))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=[],
                                                      target_parameters=["mlp.experts.down_proj"]))
    model.merge_adapter()
    with pytest.raises(NotImplementedError, match="adapters='merged'") as info:
        weight_source(model, adapters="merged")
    msg = str(info.value)
    assert "PEFT ParamWrapper 'base_model.model.model.layers.0.mlp.experts'" in msg, msg
    assert "adapters ['default'] are already merged into it" in msg and "adapters='only'" in msg, msg
    assert sorted(dict(weight_source(model, adapters="only").iter_full())) == sorted(
        peft.utils.get_peft_model_state_dict(model))


def test_quantize_refuses_adapters_and_bad_choices_before_anything_moves(llama) -> None:
    """One process: ``quantize`` with PEFT adapters, a ``quantize_if`` that is not callable, or
    one that chooses a tensor FP8 cannot take are refused naming what is wrong."""
    peft = pytest.importorskip("peft")
    from fsdptk.hf import weight_source

    base = transformers.AutoModelForCausalLM.from_pretrained(llama)
    with pytest.raises(TypeError, match="quantize_if must be a callable"):
        weight_source(base, quantize="fp8", quantize_if="q_proj")
    with pytest.raises(ValueError, match="quantize_if chose 'model.norm.weight' for fp8, but it has shape"):
        weight_source(base, quantize="fp8", quantize_if=lambda name, t: name == "model.norm.weight")
    only_q = weight_source(base, quantize="fp8", quantize_if=lambda name, t: name.endswith("q_proj.weight"))
    assert [m.name for m in only_q.metadata if m.dtype == torch.float8_e4m3fn] == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    for adapters in ("merged", "only"):
        with pytest.raises(ValueError, match=f"quantizing adapters, alone or merged, is not supported: got "
                                             f"adapters='{adapters}'"):
            weight_source(model, adapters=adapters, quantize="fp8")


def test_quantized_source_is_what_vllm_takes(llama) -> None:
    """Where vLLM imports: the quantized source is vLLM's ``WeightSource`` of its ``ParamMeta`` (float8
    weights, float32 scales), ``Fp8Config.from_config`` reads its ``quantization_config`` (the block,
    the head skipped, the layers' projections quantized), and its bytes equal vLLM's own
    ``per_block_cast_to_fp8`` of the weight."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from fsdptk.hf import weight_source

    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    source = weight_source(model, quantize="fp8-ue8m0", block_size=(32, 32))
    assert isinstance(source, WeightSource) and all(isinstance(m, ParamMeta) for m in source.metadata)
    meta = {m.name: m for m in source.metadata}
    q_name = "model.layers.0.self_attn.q_proj"
    assert meta[f"{q_name}.weight"].dtype == torch.float8_e4m3fn
    assert meta[f"{q_name}.weight_scale_inv"].dtype == torch.float32
    parsed = Fp8Config.from_config(source.quantization_config)
    assert parsed.weight_block_size == [32, 32]
    assert is_layer_skipped("lm_head", parsed.ignored_layers) and not is_layer_skipped(q_name, parsed.ignored_layers)
    full = dict(source.iter_full())
    q, scale = per_block_cast_to_fp8(model.get_parameter(f"{q_name}.weight").detach(), [32, 32], use_ue8m0=True)
    assert torch.equal(full[f"{q_name}.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(full[f"{q_name}.weight_scale_inv"], scale)


def test_metadata_records_validate_like_vllm() -> None:
    from fsdptk.hf._weight_meta import ParamMeta, Replicate, Shard

    ok = ParamMeta("w", torch.float32, [4, 2], owners=(2, 0), placements=(Shard(1),))
    assert (ok.shape, ok.owners, ok.mesh_shape, ok.placements) == ((4, 2), (2, 0), (2,), (Shard(1),))
    every = ParamMeta("w", torch.float32, (4, 2))
    assert every.owners is None and every.mesh_shape is None and every.placements is None
    replicated = ParamMeta("w", torch.float32, (4, 2), owners=(0, 1), placements=(Replicate(),))
    assert replicated.placements is None  # all-Replicate is the whole tensor, as vLLM normalizes it
    for kw, needle in [({"owners": ()}, "owners must be distinct"), ({"owners": (0, 0)}, "owners must be distinct"),
                       ({"mesh_shape": (3,)}, "does not cover its 2 owners"),
                       ({"placements": (Shard(2),)}, "shards dim 2 of a 2-D tensor"),
                       ({"placements": (Replicate(), Shard(0))}, "2 placements for a 1-D mesh")]:
        args = {"owners": (0, 1), "placements": (Shard(0),), **kw}
        with pytest.raises(ValueError, match=needle) as info:
            ParamMeta("layers.0.w", torch.float32, (4, 2), **args)
        assert "'layers.0.w'" in str(info.value)
    with pytest.raises(ValueError, match="without owners"):
        ParamMeta("w", torch.float32, (4, 2), placements=(Shard(0),))
    with pytest.raises(TypeError, match="neither Replicate nor Shard"):
        ParamMeta("w", torch.float32, (4, 2), owners=(0,), placements=("Shard(0)",))


_FAKE_VLLM_BASE = """
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple
    owners: tuple = field(default=None, kw_only=True)
    mesh_shape: tuple = field(default=None, kw_only=True)
    placements: tuple = field(default=None, kw_only=True)


class WeightSource(ABC):
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.__dict__.get("metadata"), (cached_property, type(None))):
            raise TypeError("metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self): ...

    def owned_names(self, rank):
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def iter_full(self):
        raise NotImplementedError

    def iter_local(self):
        raise NotImplementedError
"""

_PROBE = """
import sys, torch
import fsdptk.hf
assert "vllm" not in sys.modules, "imported by fsdptk.hf"
source = fsdptk.hf.weight_source(torch.nn.Linear(3, 2))
rows = [(m.name, type(m).__module__) for m in source.metadata]
full = [n for n, _ in source.iter_full()]
print(repr((rows, full, "vllm" in sys.modules, [c.__module__ for c in type(source).__mro__])))
"""


def _probe(tmp_path: Path, with_vllm: bool) -> tuple:
    import ast
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if with_vllm:  # a stand-in with vLLM 0.33's WeightSource / ParamMeta shapes, on the path
        base = tmp_path / "vllm" / "distributed" / "weight_transfer"
        base.mkdir(parents=True)
        for d in (tmp_path / "vllm", tmp_path / "vllm" / "distributed", base):
            (d / "__init__.py").write_text("")
        (base / "base.py").write_text(_FAKE_VLLM_BASE)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_without_vllm_nothing_of_vllm_is_imported(tmp_path) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    rows, full, imported, mro = _probe(tmp_path, with_vllm=False)
    assert rows == [("weight", "fsdptk.hf._weight_meta"), ("bias", "fsdptk.hf._weight_meta")]
    assert full == ["weight", "bias"] and not imported
    assert not any(m.startswith("vllm") for m in mro)


def test_with_vllm_the_source_is_vllms_weight_source_of_its_param_meta(tmp_path) -> None:
    rows, full, imported, mro = _probe(tmp_path, with_vllm=True)
    assert rows == [("weight", "vllm.distributed.weight_transfer.base"),
                    ("bias", "vllm.distributed.weight_transfer.base")]
    assert full == ["weight", "bias"] and imported
    assert "vllm.distributed.weight_transfer.base" in mro
