"""Weights out to an inference engine: :func:`weight_source`, vLLM 0.33's ``WeightSource`` over a
(sharded) model, in the Hub checkpoint's names and shapes.

The names, shapes and tensors are exactly what :func:`fsdptk.save_safetensors` writes (the same
items, the same conversion to the Hub layout, the same engine ``collect``): a save whose consumer
hands each bucket to an engine instead of a file. Every full tensor travels point to point to its
owner (rank 0, or the ranks ``owners`` names, assigned as the writers of
``save_safetensors(writers=W)`` are); the per-bucket status agreement of the engine keeps the ranks
in step however slowly an owner consumes. With ``owners="all"`` (every rank owns every name, as
vLLM's M2N engine needs) the Hub tensors that the ranks already hold as a ``torch.chunk`` split of
a DTensor in rank order (FSDP's ``Shard(0)``, HSDP; at most two mesh axes, one sharded, as vLLM's
M2N engine takes them) are declared with that mesh shape and those placements, and :meth:`HubWeightSource.iter_local` yields them without any
communication.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from functools import cached_property
from typing import Any, Literal, cast

import torch
from torch import nn

from fsdptk import _engine
from fsdptk._core.arguments import arguments_view
from fsdptk._core.compat import local_tensor
from fsdptk._core.dist import all_gather_object, error_payload, host_key, raise_if_any, raise_lowest
from fsdptk._core.dist import world as _world
from fsdptk._engine.agree import fingerprint
from fsdptk._engine.sources.convert import Unconverter
from fsdptk._plans.hub_items import Items, Plan
from fsdptk._plans.hub_pieces import box_pieces, splittable
from fsdptk._plans.source_plan import Held, Ownership, ownership, plan_source
from fsdptk.hf._weight_layout import SourceView, check, raise_disagreement
from fsdptk.hf._weight_meta import ParamMeta, RecordTypes, SparseWeightPatch, patch_type, record_types
from fsdptk.hf._weight_patches import Tracker, patch_pass

__all__ = ["weight_source", "HubWeightSource", "ParamMeta", "SparseWeightPatch"]

Owners = int | Literal["host", "all"]
Bucket = list[tuple[str, torch.Tensor]]


class HubWeightSource:
    """A model's weights as vLLM's ``WeightSource``: made by :func:`weight_source` (see there).

    ``metadata`` and :meth:`owned_names` need no communication; the iterators are collective
    (every rank iterates each pass to its end) and each pass reads the model's current weights.
    """

    def __init__(self, model: nn.Module, plan: Plan, layout: Ownership, bucket_bytes: int, types: RecordTypes,
                 keep_buffers: bool = False, tracker: Tracker | None = None, patch_cls: type | None = None) -> None:
        self._model, self._plan, self._layout = model, plan, layout
        self._bucket_bytes = bucket_bytes
        self._types = types
        self._pool = _engine.Pool(cap=0) if keep_buffers else None  # kept between passes
        self._tracker = tracker  # the baseline (track_changes=True), else None
        self._patch_cls = patch_cls
        self._wire = _wire_dtypes(plan)

    # -- metadata -------------------------------------------------------------------------------
    @cached_property
    def metadata(self) -> list[Any]:
        """Every Hub tensor, in iteration order: ``ParamMeta(name, dtype, shape, *, owners,
        mesh_shape, placements)`` (vLLM's classes when vLLM is importable), the same on every rank."""
        types, layout = self._types, self._layout
        out = []
        for name, dtype, shape in self._plan.hub:
            mesh_shape, placements = None, None
            if name in layout.grids:
                mesh_shape, dims = layout.grids[name]
                placements = tuple(types.shard(d) if d >= 0 else types.replicate() for d in dims)
            out.append(types.meta(name, dtype, shape, owners=layout.owners[name], mesh_shape=mesh_shape,
                                  placements=placements))
        return out

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """The ``quantization_config`` of the release the source streams (what
        ``save_safetensors(quantize=...)`` writes into ``config.json``, and what an engine builds its
        ``Fp8Config`` / ``Mxfp4Config`` from); ``None`` when unquantized. A fresh copy each time."""
        config = self._plan.quantization_config
        return None if config is None else {k: list(v) if isinstance(v, list) else v for k, v in config.items()}

    def owned_names(self, rank: int) -> list[str]:
        """The Hub names ``rank`` yields (in both modes), in metadata order: those whose record lists
        it in ``owners`` (vLLM's definition).

        Raises:
            ValueError: ``rank`` is not a rank of the world (names it).
        """
        world = _world()[0]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
        return [name for name, _, _ in self._plan.hub if rank in self._layout.owners[name]]

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`iter_full`."""
        return self.iter_full()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each Hub tensor this rank owns, whole, in metadata order (nothing on the others).

        Collective: every rank drives it to the end (see :func:`weight_source` for a rank that
        leaves early). ``.throw(exc)`` into it on one rank raises
        ``exc`` on every rank at the next bucket boundary.
        """
        return _flatten(self.iter_buckets())

    def iter_buckets(self) -> Iterator[Bucket]:
        """Lists of ``(name, tensor)`` of at most ``bucket_bytes`` (a larger tensor alone) on the
        owners, ``[]`` elsewhere; every rank iterates to the end (collective)."""
        every = list(range(len(self._plan.keys)))
        return self._tracked(lambda failed: self._stream(every, names=None, failed=failed))

    def iter_patches(self) -> Iterator[Any]:
        """Only what changed since the last pass that completed on every rank: on each owner, one
        ``SparseWeightPatch(name, indices, values, full_shape)`` per owned Hub tensor whose wire bits
        changed (vLLM's class where vLLM is importable, fsdptk's own otherwise), in metadata order;
        nothing on the other ranks. ``indices`` are int32, 1-D, strictly ascending flat indices (C
        order) into the full Hub tensor, ``values`` the new values in the wire dtype. Needs
        ``weight_source(..., track_changes=True)`` (see there for the baseline, abandoned passes
        and memory).

        Collective: every rank drives it to its end, as every pass. Checked on every rank before
        anything is yielded: a source made without ``track_changes=True``, no completed pass yet,
        a changed element that is NaN now (it would read as "unchanged" at vLLM's receiver) or a
        changed integer tensor (each tensor named, with the count). For the tensors compared whole
        on their owner (merged LoRA, NF4, other conversions) the NaN and integer checks run as
        each arrives there: raised on every rank before that tensor's patch is yielded, after the
        patches before it (the pass then counts as abandoned: the next one sends those again).

        Raises:
            ValueError: as above, on every rank.
        """
        tracker = self._tracker
        if tracker is None:
            raise ValueError("iter_patches needs a source made with weight_source(..., track_changes=True): this "
                             "one keeps no baseline to compare against (track_changes=False)")
        if not tracker.valid:
            raise ValueError("iter_patches: no baseline: run iter_full first (no pass of this source has completed "
                             "on every rank yet, so nothing says what the engine holds)")
        assert self._patch_cls is not None, "set with the tracker"
        patch_cls = self._patch_cls
        return patch_pass(tracker, self._items, lambda keep, names: self._stream(keep, names, patching=True),
                          lambda name, idx, vals, shape: patch_cls(name, idx, vals, shape), self._bucket_bytes)

    def _tracked(self, make: Callable[[BaseException | None], Iterator[Any]]) -> Iterator[Any]:
        """A full pass (``make(failed)``, ``failed`` this rank's error so far): with
        ``track_changes``, every piece this rank keeps is compared and updated first, and the pass
        becomes the baseline once it completes on every rank."""
        tracker = self._tracker
        if tracker is None:
            return make(None)
        return self._tracked_pass(tracker, make)

    def _tracked_pass(self, tracker: Tracker, make: Callable[[BaseException | None], Iterator[Any]]
                      ) -> Iterator[Any]:
        tracker.begin()
        failed: BaseException | None = None
        try:
            tracker.diff(self._items(), patch=False)
        except Exception as e:  # noqa: BLE001 - agreed by the pass's first exchange
            failed = e
        completed = False
        try:
            yield from make(failed)
            completed = True
        finally:
            tracker.finish(completed)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each Hub tensor this rank owns as its piece, as its record's placements say, in metadata
        order. With ``owners="all"`` the pieces a rank already holds (``mesh_shape`` and
        ``placements`` in the record) are views of its shards, or cast copies, moved by no one; every
        other tensor is whole on every rank (gathered to each). With one owner per name it is
        :meth:`iter_full`. Collective: every rank iterates to the end.
        """
        if not self._layout.grids:
            return self.iter_full()
        return self._tracked(self._iter_pieces)

    def _iter_pieces(self, failed: BaseException | None) -> Iterator[tuple[str, torch.Tensor]]:
        plan, grids = self._plan, self._layout.grids
        pending: list[tuple[int, str, str, torch.Tensor]] = []
        try:
            if failed is None:
                pending = self._local_pieces()
        except Exception as e:  # noqa: BLE001 - agreed by collect's exchange
            failed = e
        gathered = {n for n, _, _ in plan.hub if n not in grids}
        keep = [i for i, k in enumerate(plan.keys) if gathered & set(plan.item_hub[k])]
        gen = cast(Generator[Bucket, None, None], self._stream(keep, names=gathered, failed=failed))
        try:
            for bucket in gen:
                for name, t in bucket:
                    while pending and pending[0][0] < plan.order[name]:
                        _, piece_name, key, piece = pending.pop(0)
                        try:
                            yield piece_name, piece.to(plan.dtypes[key])
                        except Exception as e:  # noqa: BLE001 - the caller's .throw(e): agreed by the engine
                            gen.throw(e)
                    try:
                        yield name, t
                    except Exception as e:  # noqa: BLE001 - the caller's .throw(e): agreed by the engine
                        gen.throw(e)
        except GeneratorExit:  # the consumer left (close(), or a break or an error dropped the iterator)
            gen.close()  # the engine's next agreement: every other rank raises, naming this rank
            raise
        for _, name, key, piece in pending:  # after the last gathered tensor: agreed once more below
            if failed is None:
                try:
                    yield name, piece.to(plan.dtypes[key])
                except GeneratorExit:  # the consumer left: still the pass's last agreement, then out
                    _leave(_left_early())
                    raise
                except Exception as e:  # noqa: BLE001 - the caller's .throw(e): raised on every rank
                    failed = e
        raise_if_any(failed)

    def _local_pieces(self) -> list[tuple[int, str, str, torch.Tensor]]:
        """``(metadata index, name, model key, piece)`` of every split Hub tensor: views of this
        rank's shards (cast when yielded, one at a time)."""
        plan, layout = self._plan, self._layout
        out: list[tuple[int, str, str, torch.Tensor]] = []
        for i, (key, t) in enumerate(self._items()):
            box = layout.boxes[i]
            if box is None or not set(layout.grids) & set(plan.item_hub[key]):
                continue
            local = local_tensor(t).detach()
            node = plan.nodes.get(plan.conv_key[key]) if plan.nodes is not None else None
            pieces = box_pieces(node, box, local) if node is not None else [(plan.conv_key[key], box, local)]
            out += [(plan.order[name], name, key, piece) for name, _, piece in pieces if name in layout.grids]
        return sorted(out, key=lambda x: x[0])

    def _items(self) -> Items:
        """The model's current tensors of the planned keys (a fresh pass reads the current weights)."""
        sd = self._model.state_dict(keep_vars=True)
        out = []
        for key, shape in zip(self._plan.keys, self._plan.shapes):
            t = sd.get(key)
            if t is None or tuple(t.shape) != shape:
                raise ValueError(f"weight_source: the model's {key!r} changed since the source was made "
                                 f"(shape {shape} then, {None if t is None else tuple(t.shape)} now); "
                                 "make a new source")
            out.append((key, t))
        return out

    def _stream(self, keep: list[int], names: set[str] | None, failed: BaseException | None = None,
                patching: bool = False) -> Iterator[Bucket]:
        """Gather items ``keep`` to their owners (each to every one of its ranks), bucket by bucket,
        and turn each into its Hub tensors (``names``: only those; ``None``: all). ``failed``: this
        rank's error so far, raised on every rank by collect's first exchange. With a baseline, the
        gathered Hub tensors (compared on their owners) update it as they arrive, unless
        ``patching`` (the patch pass compares them itself)."""
        tracker = None if patching else self._tracker
        plan, layout = self._plan, self._layout
        items: Items = []
        dests: list[int] = []
        try:
            if failed is not None:
                raise failed
            every = self._items()
            for i in keep:
                items += [every[i]] * len(layout.dests[i])
                dests += layout.dests[i]
        except Exception as e:  # noqa: BLE001 - agreed by collect's exchange
            failed, items, dests = e, [], []
        buckets = cast(Generator[Bucket, None, None],
                       _engine.collect(items, bucket_bytes=self._bucket_bytes, dest=dests, failed=failed,
                                       pool=self._pool, reuse_yielded=self._pool is not None,
                                       wire_dtypes=[self._wire[k] for k, _ in items]))
        hub = _ToHub(plan)
        # no reference to a bucket is kept here once it is handed on, so that with keep_buffers the
        # engine reuses its memory for a later bucket once the consumer has dropped it
        # (fsdptk._engine.pool)
        try:
            for bucket in buckets:
                out: Bucket = []
                try:
                    out = [(n, t) for n, t in hub.feed(bucket) if names is None or n in names]
                    if tracker is not None:
                        for n, t in out:
                            if n in tracker.gathered:
                                tracker.compare_full(n, t, False)
                except Exception as e:  # noqa: BLE001 - agreed by the engine
                    buckets.throw(e)
                del bucket
                parts = _regroup(out, self._bucket_bytes) if out else [[]]
                del out
                while parts:
                    part = parts.pop(0)
                    try:
                        yield part
                    except Exception as e:  # noqa: BLE001 - the caller's .throw(e): agreed by the engine
                        buckets.throw(e)
                    del part
        except GeneratorExit:  # the consumer left: the engine's next agreement names this rank
            buckets.close()
            raise


class _ToHub:
    """A gathered bucket of model tensors -> its Hub tensors, cast, in metadata order (LoRA factors
    held until their base weight arrives, then merged into it). Quantized: each model tensor is cast
    to its dtype first and quantized from that, as a quantized save does; the weights and scales it
    makes (``plan.written``) keep their own dtypes."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.split = Unconverter(plan.nodes) if plan.nodes is not None else None
        self.factors: dict[str, torch.Tensor] = {}

    def feed(self, bucket: Bucket) -> Bucket:
        plan = self.plan
        out: list[tuple[int, str, torch.Tensor]] = []
        for key, full in bucket:
            if key in plan.lora:
                self.factors[key] = full
                continue
            if key in plan.merges:
                merge = plan.merges[key]
                full = merge.merged(full, self.factors.pop(merge.a), self.factors.pop(merge.b))
            ck = plan.conv_key[key]
            if self.split is None:
                pieces = [(ck, full)]
            else:
                pieces = self.split.feed(ck, full.to(plan.dtypes[key]) if plan.written else full)
            for name, piece in pieces:
                piece = piece if name in plan.written else piece.to(plan.dtypes[key])
                out.append((plan.order[name], name, piece.contiguous()))
            del full
        return [(n, t) for _, n, t in sorted(out, key=lambda x: x[0])]


def _wire_dtypes(plan: Plan) -> dict[str, torch.dtype | None]:
    """Per model key, the dtype its pieces travel in: its Hub dtype where the conversion only moves
    data (renames, stacks, concatenations, transpositions: a cast before it is the cast after it,
    bit for bit), so a bf16 stream of an fp32 model moves half the bytes; ``None`` (its own dtype)
    for a LoRA factor or a base weight an adapter is merged into (PEFT's merge runs in the model's
    dtypes) and for other conversions."""
    out: dict[str, torch.dtype | None] = {}
    for k in plan.keys:
        node = plan.nodes.get(plan.conv_key[k]) if plan.nodes is not None and k in plan.conv_key else None
        moves_only = node is None or splittable(node)
        out[k] = plan.dtypes[k] if moves_only and k not in plan.lora and k not in plan.merges else None
    return out


def _regroup(out: Bucket, limit: int) -> list[Bucket]:
    """``out`` in consecutive lists of at most ``limit`` bytes (a larger tensor alone)."""
    parts: list[Bucket] = [[]]
    size = 0
    for name, t in out:
        n = t.numel() * t.element_size()
        if parts[-1] and size + n > limit:
            parts.append([])
            size = 0
        parts[-1].append((name, t))
        size += n
    return parts


def _flatten(buckets: Iterator[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' pairs one by one, holding none of them once handed on (see ``_stream``)."""
    gen = cast(Generator[Bucket, None, None], buckets)
    try:
        for bucket in gen:
            pairs = bucket[::-1]
            del bucket
            while pairs:
                pair = pairs.pop()
                try:
                    yield pair
                except Exception as e:  # noqa: BLE001 - agreed by the engine
                    gen.throw(e)
                del pair
    except GeneratorExit:  # the consumer left: the engine's next agreement names this rank
        gen.close()
        raise


def _left_early() -> RuntimeError:
    """This rank's error when its consumer leaves a pass before the end (what the other ranks raise)."""
    return RuntimeError(f"weight_source: rank {_world()[1]} stopped iterating before the end of the pass (its "
                        "consumer raised, broke out of its loop or closed the iterator); that rank's own code "
                        "has the cause")


def _leave(error: BaseException) -> None:
    """Take part in the pass's last agreement with ``error`` (a rank leaving early): every other
    rank raises it, naming this rank; this rank goes on leaving."""
    try:
        raise_if_any(error)
    except Exception:  # noqa: BLE001 - raised on the other ranks; this one is already leaving
        pass


# ----------------------------------------------------------------------------------------------
# the public call
def weight_source(
    model: nn.Module,
    *,
    conversion: Literal["auto"] | None = "auto",
    dtype: torch.dtype | None = None,
    owners: Owners = 1,
    bucket_bytes: int | None = None,
    adapters: Literal["merged", "only"] | None = None,
    quantize: Literal["fp8", "fp8-ue8m0", "mxfp4"] | None = None,
    block_size: tuple[int, int] | None = (128, 128),
    quantize_if: Callable[[str, torch.Tensor], bool] | None = None,
    keep_buffers: bool = False,
    track_changes: bool = False,
) -> HubWeightSource:
    """The model's weights as vLLM 0.33's ``WeightSource``, in the Hub checkpoint's names and shapes.

    Call on every rank (collective: one object exchange agrees the arguments and who holds what,
    before any tensor moves). The names, shapes and values are what
    ``save_safetensors(model, path, conversion=conversion, dtype=dtype, quantize=quantize,
    block_size=block_size, quantize_if=quantize_if)`` writes: per-expert tensors for transformers'
    fused experts, a tied tensor once, NF4 weights dequantized, an FP8 or MXFP4 release's weights and
    scales when quantized. The source has:

    - ``metadata`` (a cached property): one ``ParamMeta(name, dtype, shape, *, owners, mesh_shape,
      placements)`` per Hub tensor, in iteration order, the same on every rank. ``owners`` are the
      ranks that yield the name, in both modes (vLLM's definition): one rank per name with
      ``owners`` 1, W or ``"host"``; every rank, in rank order, with ``owners="all"``, where a Hub
      tensor the ranks already hold as a ``torch.chunk`` split of a DTensor over the ranks in rank
      order has that ``mesh_shape`` and ``Shard(d)`` / ``Replicate()`` placements where vLLM's M2N
      engine can take them (at most two mesh axes, one sharded: FSDP's ``Shard(0)``, HSDP, FSDP of
      the tensors TP leaves whole) and every other one ``placements=None`` (whole).
    - ``owned_names(rank)``: the names ``rank`` yields, in metadata order; their union is every name.
    - ``iter_full()``: each owned name as a full CPU tensor, in metadata order; nothing on the other
      ranks. Each tensor is gathered point to point to its owner only (never an all-gather; with
      ``owners="all"`` to every rank in turn), so a rank holds at most its shards plus about two
      buckets.
    - ``iter_local()``: each owned name as this rank's piece, as its record says: the pieces a rank
      already holds are views of its shards (no communication), the others whole, gathered as by
      ``iter_full`` (with one owner per name it is ``iter_full``).
    - ``iter_buckets()``: ``iter_full`` as lists of ``(name, tensor)`` up to ``bucket_bytes`` (a
      larger tensor alone) on the owners, ``[]`` elsewhere (engines that take flattened buckets).
    - ``iter_patches()`` (with ``track_changes=True``): only what changed since the last pass that
      completed on every rank, as vLLM's ``SparseWeightPatch(name, indices, values, full_shape)``:
      int32 ascending flat indices into the Hub tensor and the new values, on each owner, one per
      changed Hub tensor; each holder sends its owner only its changed elements.
    - ``quantization_config``: the ``quantization_config`` a quantized save writes into
      ``config.json`` (what an engine builds its ``Fp8Config`` / ``Mxfp4Config`` from); ``None``
      unquantized.

    Every iterator is collective: every rank drives it to its end, each pass reads the current
    weights, and an owner may consume lazily (send on another process group, sleep) while the
    others wait at the next bucket's status agreement. A failure on any rank, or ``exc`` thrown in
    with ``iterator.throw(exc)`` on one rank, is raised on every rank. A consumer that leaves a pass
    early on one rank (its code raises, it breaks out of its loop, or it calls ``close()``: the
    iterator is closed, at the latest when it is dropped) still takes part in the pass's next
    agreement, so every other rank raises a RuntimeError naming that rank within a bucket, never at
    a process-group timeout; the leaving rank goes on with its own error, or none. When vLLM's
    ``vllm.distributed.weight_transfer.base`` (vLLM 0.33) is importable the source is an instance of
    vLLM's ``WeightSource`` and the records are vLLM's ``ParamMeta``; otherwise fsdptk's own records
    (and with no vLLM installed, fsdptk never imports vLLM). What each rank can import is agreed in
    the first exchange: ranks that would make different records raise one error naming them.

    Memory: by default every tensor handed to the consumer is fresh memory, the consumer's whatever
    it does with it (keeps it, a view, its ``untyped_storage()``, a raw pointer, or shares it with
    another process): it is never written over. ``keep_buffers=True`` opts in to reuse (see there).

    Args:
        model: the model (FSDP2-sharded, tensor- or expert-parallel, or plain), the same structure
            on every rank.
        conversion: ``"auto"``: the Hub layout of a transformers model (transformers' own rules,
            run backwards as the save does); ``None``: the model's own keys.
        dtype: cast floating tensors to this dtype (``torch.bfloat16`` rollouts from an fp32
            master); integer tensors are kept. ``None``: the model's dtypes.
        owners: ``1``: rank 0 owns every name (vLLM's NCCL broadcast engine: the other ranks drive
            ``iter_full`` and get nothing); ``W``: names spread over ``W`` ranks (``[w * N // W]``)
            by bytes, whole Hub tensors (all of one fused tensor's together), as
            ``save_safetensors(writers=W)`` assigns files; ``"host"``: the lowest rank of every host;
            ``"all"``: every rank owns every name (vLLM's M2N engine, which consumes ``iter_local``,
            and its IPC engine, where every rank sends every tensor).
        bucket_bytes: full-tensor bytes per bucket and owner (default: the engine's, 16 MiB).
        adapters: for a PEFT model: ``"merged"``: the base weights with each LoRA layer of the
            active adapter merged in, as ``merge_and_unload`` merges it (PEFT's op order and dtypes,
            so the tensors are its own bit for bit) under the base model's Hub names: plain LoRA on
            linear layers (``W + scaling * B @ A``) and LoRA on fused MoE experts (PEFT's
            ``ParamWrapper``, ``target_parameters``: each expert's ``W_e + scaling * B_e @ A_e``,
            yielded as the per-expert Hub tensors);
            ``"only"``: the active adapter's tensors under PEFT's names
            (``get_peft_model_state_dict``), the base weights never moved. ``None``: the model's
            tensors as they are.
        quantize: stream a quantized release, exactly what ``save_safetensors(quantize=...)`` writes
            (bit for bit, the same tensors chosen): ``"fp8"`` (e4m3 weights, a float32
            ``<w>_scale_inv`` per ``block_size`` block, the grid rounded up), ``"fp8-ue8m0"`` (scales
            rounded up to powers of two, ``scale_fmt: "ue8m0"``), ``"mxfp4"`` (gpt-oss's experts as
            uint8 ``<w>_blocks`` / ``<w>_scales``). By default the linear weights of the decoder
            layers are quantized (embeddings, the head, norms, biases and routers keep ``dtype``).
            Each weight is quantized on its owner from the gathered tensor cast to ``dtype``, one
            bucket at a time; the quantized weights and their scales are yielded whole by their
            owner (never as ``iter_local`` pieces). Not with ``adapters``. ``None`` (default):
            unquantized.
        block_size: FP8's ``(rows, columns)`` per scale (default ``(128, 128)``; MXFP4's groups of
            32 are fixed); ``None`` is accepted unless ``quantize`` is ``"fp8"`` / ``"fp8-ue8m0"``.
        quantize_if: ``(Hub name, tensor) -> bool`` choosing the tensors to quantize instead of the
            default rule (the tensor is on ``meta``, of the Hub shape and dtype).
        keep_buffers: reuse the memory of the tensors handed to the consumer, within a pass and
            from one pass to the next, so that every pass after the first writes into warm memory
            instead of fresh pages. The contract: a yielded tensor's memory may be written over
            once nothing holds it through torch: no tensor or view of it, and no Python object of
            its storage (``t.untyped_storage()``); a raw pointer (``data_ptr()``, ctypes, memory
            registered with a device) is the consumer's to keep valid: it holds the tensor (or
            its storage object) as long as it uses the pointer. Memory shared with another process
            (``share_memory_()``, or sent through a ``torch.multiprocessing`` queue) is never
            reused. Between passes the source keeps at most ``2 * max(bucket_bytes, L) -
            bucket_bytes`` bytes on a rank, ``L`` the largest full tensor the rank receives (what
            the consumer still holds at the end of a pass is forgotten beyond that: freed when it
            lets go). ``False`` (default): only the engine's own wire buffers are reused, within a
            pass, and nothing is kept between passes. Per rank (not agreed: it changes no message).
        track_changes: keep a baseline for :meth:`HubWeightSource.iter_patches` (only the changed
            elements, in checkpoint coordinates). Each rank that sends a box of a model tensor to
            its owner (one holder per distinct box: HSDP and TP replicas keep nothing) keeps its
            pieces of the Hub tensors in the wire dtype, as the last pass that completed on every
            rank delivered them; a tensor no holder can cut into Hub pieces on its own (a LoRA
            layer merged into its base weight, NF4, a conversion other than renames, stacks,
            concatenations and transpositions) is compared whole on its owner, which keeps it.
            Every pass (``iter_full``, ``iter_local``, ``iter_buckets``, ``iter_patches``)
            compares and updates the baseline as it starts, in chunks of at most ``bucket_bytes``
            (a chunk cast to the wire dtype and its mask), and holds
            the positions to send until it ends (int32, 4 bytes per changed element; see
            docs/weight_sync.md for measured peaks); a pass abandoned on any rank leaves
            the positions it could have changed at the engine "uncertain", sent by the next patch
            pass whatever their bits. Not with ``quantize`` (the scales move with every value).
            ``False`` (default): nothing is kept, and ``iter_patches`` raises.

    Returns:
        HubWeightSource: the source (a subclass of vLLM's ``WeightSource`` when vLLM's records are
        importable).

    Raises:
        TypeError: ``model`` is not a module, ``dtype`` is not a floating dtype, ``owners`` is not an
            int, ``"host"`` or ``"all"``, ``conversion`` is not ``"auto"`` or ``None``,
            ``keep_buffers`` or ``track_changes`` is not a bool,
            ``quantize_if`` is not callable or returns something other than a bool; on every rank.
        ValueError: ``owners`` out of ``[1, world size]``, ``bucket_bytes`` not a positive int,
            ``track_changes=True`` with ``quantize``, or with a Hub tensor of ``2**31`` elements or
            more (int32 patch indices; named),
            ``adapters`` not accepted, ``quantize`` not one of the formats (or with ``adapters``),
            ``block_size`` not two positive ints, ``quantize_if`` choosing a tensor the format
            cannot take, nothing to quantize (``"mxfp4"`` of a model without gpt-oss experts), a
            tensor still on ``meta``, ranks that passed different arguments (each differing
            argument named with every rank's value), ranks that can import different record types
            (vLLM's on some, fsdptk's own or another vLLM version on others: each rank's named); on
            every rank, before any tensor moves.
        ImportError: vLLM has ``vllm.distributed.weight_transfer.base`` but importing it fails on
            a rank (naming vLLM's version and the cause); on every rank.
        NotImplementedError: ``adapters="merged"`` on what it does not merge, naming the layer and
            why: a tuner other than LoRA, LoRA on a layer other than ``torch.nn.Linear`` and not a
            ``ParamWrapper``, DoRA, ``fan_in_fan_out``, LoRA biases, an adapter already merged
            into its layer, a wrapped parameter in float8, several active adapters.

    Examples:
        >>> import torch
        >>> from fsdptk.hf import weight_source
        >>> source = weight_source(torch.nn.Linear(2, 3), dtype=torch.bfloat16)
        >>> [(m.name, m.dtype, m.shape, m.owners) for m in source.metadata]
        [('weight', torch.bfloat16, (3, 2), (0,)), ('bias', torch.bfloat16, (3,), (0,))]
        >>> [(name, tuple(t.shape)) for name, t in source.iter_full()], source.owned_names(0)
        ([('weight', (3, 2)), ('bias', (3,))], ['weight', 'bias'])
        >>> [m.placements for m in weight_source(torch.nn.Linear(2, 3), owners="all").metadata]
        [None, None]
        >>> layers = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(64, 32)])})
        >>> fp8 = weight_source(layers, quantize="fp8", block_size=(16, 16))  # an FP8 release
        >>> [(m.name, m.dtype, m.shape) for m in fp8.metadata]  # doctest: +NORMALIZE_WHITESPACE
        [('layers.0.weight', torch.float8_e4m3fn, (32, 64)),
         ('layers.0.weight_scale_inv', torch.float32, (2, 4)), ('layers.0.bias', torch.float32, (32,))]
        >>> fp8.quantization_config["weight_block_size"], [t.dtype for _, t in fp8.iter_full()]
        ([16, 16], [torch.float8_e4m3fn, torch.float32, torch.float32])
        >>> tracked = weight_source(layers, dtype=torch.bfloat16, track_changes=True)
        >>> engine = dict(tracked.iter_full())  # the baseline: what the engine holds now
        >>> with torch.no_grad():
        ...     layers.layers[0].weight[1, 2] += 1.0
        >>> [(p.name, p.indices.tolist(), p.full_shape) for p in tracked.iter_patches()]
        [('layers.0.weight', [66], (32, 64))]
        >>> weight_source(layers, quantize="int8")
        Traceback (most recent call last):
        ValueError: quantize must be None, 'fp8', 'fp8-ue8m0' or 'mxfp4', got 'int8'
    """
    world, rank = _world()
    arguments = arguments_view("weight_source", conversion=conversion, dtype=dtype, owners=owners,
                               bucket_bytes=bucket_bytes, adapters=adapters, quantize=quantize,
                               block_size=block_size, quantize_if=quantize_if, track_changes=track_changes)
    error: BaseException | None = None
    plan: Plan | None = None
    holding = Held([], [], [])
    nbytes = 0
    types: RecordTypes | None = None
    patch_cls: type | None = None
    try:
        if not isinstance(keep_buffers, bool):
            raise TypeError(f"keep_buffers must be a bool, got {keep_buffers!r}")
        if not isinstance(track_changes, bool):
            raise TypeError(f"track_changes must be a bool, got {track_changes!r}")
        if track_changes and quantize is not None:
            raise ValueError(f"track_changes=True with quantize={quantize!r}: a quantized release's scales move "
                             "with every value, so patches of it are not supported; stream it with iter_full, "
                             "or track an unquantized source")
        types = record_types()  # what this rank can import of vLLM: agreed in the exchange below
        nbytes = check(model, conversion, dtype, owners, bucket_bytes, adapters, quantize, block_size, quantize_if,
                       world)
        plan, holding = plan_source(model, conversion=conversion, dtype=dtype, adapters=adapters, quantize=quantize,
                                    block_size=block_size, quantize_if=quantize_if, world=world,
                                    track_changes=track_changes)
        if track_changes:
            patch_cls = patch_type(types)
    except Exception as e:  # noqa: BLE001 - raised on every rank after the exchange
        error = e
    fp = fingerprint([*((k, s) for k, s in zip(plan.keys, plan.shapes)), *plan.hub]) if plan is not None else None
    views = all_gather_object(SourceView(arguments=arguments, error=error_payload(error), fingerprint=fp,
                                         boxes=holding.boxes, plain=holding.plain, meshes=holding.meshes,
                                         host=host_key(),
                                         records=types.kind if types is not None else None))
    raise_lowest([v.error for v in views], error)
    raise_disagreement(views)
    assert plan is not None and types is not None, "planned on every rank (agreed just above)"
    layout = ownership(plan, owners, rank, [Held(v.boxes, v.plain, v.meshes) for v in views], [v.host for v in views],
                       track_changes=track_changes)
    tracker = Tracker(plan, layout, rank, nbytes) if track_changes else None
    if types.base is None:
        return HubWeightSource(model, plan, layout, nbytes, types, keep_buffers, tracker, patch_cls)
    # an instance of vLLM's WeightSource (its __init_subclass__ checks the cached metadata)
    cls = type("HubWeightSource", (HubWeightSource, types.base),
               {"__module__": __name__, "metadata": HubWeightSource.__dict__["metadata"]})
    return cast(HubWeightSource, cls(model, plan, layout, nbytes, types, keep_buffers, tracker, patch_cls))
