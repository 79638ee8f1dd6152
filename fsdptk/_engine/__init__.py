"""The tensor-moving engine shared by model state, optimizer state and checkpoint files.

Two primitives over an ordered list of ``(fqn, target)`` pairs, where a target is a sharded
``DTensor`` (any mesh and placements DTensor produces, ``_StridedShard`` included), a plain tensor
(replicated: an unsharded submodule's parameter, a buffer) or an NF4 tensor (plain or inside a
DTensor). Targets may live on ``meta``: outputs are then allocated on the requested device.

* :func:`agree` + :func:`distribute`: full tensors -> this rank's shards. Metadata (keys, shapes,
  dtypes) is agreed on every rank first with ONE object collective, so every error is raised on
  every rank. Then either each rank reads its own piece of a source it can read (no tensor moves;
  a lazy source is read shard-on-read), or rank 0 sends each rank its slices of a bucket of
  tensors: small ones packed into one flat byte buffer per rank, large dim-0 ones alone, from and
  into their final memory (zero-copy), bucket k+1 packed while bucket k is on the wire.
* :func:`collect`: local shards -> full CPU tensors on each item's destination rank (rank 0, a
  writer, an owner), bucket by bucket, with point-to-point sends of exactly the bytes each box's
  chosen holder has (one replica per HSDP group), large dim-0 pieces received straight into the
  full tensors. Each rank posts a bucket's messages as one batch, receives first, so transfers
  cannot block each other on any backend (``wire``'s "Point-to-point order").

Everything runs on the process group of ``fsdptk._core.dist.comm_group()`` (the default group unless
the calling thread chose another). See ``docs/state_dict.md``. The parts:

- :mod:`~fsdptk._engine.sources`: the source protocol (metadata, read a box, release);
- :mod:`~fsdptk._engine.layouts`: one class per kind of target (plain, DTensor, NF4, DTensor NF4);
- :mod:`~fsdptk._engine.wire`: flat buffers of aligned pieces, direct (zero-copy) pieces, buckets,
  the two-bucket pipeline, the point-to-point order (one batch per bucket, receives first);
- :mod:`~fsdptk._engine.routes`: a gather's routes (which holder sends each box; each rank's
  messages of a bucket), pure;
- :mod:`~fsdptk._engine.agree`: the metadata agreement and the per-bucket status agreement (the
  failure protocol, ``docs/failure_model.md``);
- :mod:`~fsdptk._engine.scatter` (:func:`distribute`) and :mod:`~fsdptk._engine.gather`
  (:func:`collect`);
- :mod:`~fsdptk._engine.pool`: the gather's reused CPU memory (a block handed out again only once
  nobody holds it).
- :mod:`~fsdptk._engine.owners`: owner rounds: each item's pieces to its owner, computed there on
  the full item, each holder's piece of the result back (:class:`fsdptk.Muon`'s step).
"""

from fsdptk._engine.agree import LoadPlan, agree, check_source, merge_checks
from fsdptk._engine.gather import collect
from fsdptk._engine.layouts import layout_of
from fsdptk._engine.pool import Pool
from fsdptk._engine.routes import Holdings, choose_senders
from fsdptk._engine.scatter import distribute
from fsdptk._engine.sources import ShapesSource, Source, TensorMeta
from fsdptk._engine.wire import DEFAULT_BUCKET_BYTES

__all__ = ["agree", "distribute", "collect", "Pool", "Holdings", "choose_senders", "LoadPlan", "TensorMeta", "Source", "ShapesSource",
           "DEFAULT_BUCKET_BYTES", "bucket_size", "check_source", "merge_checks", "layout_of"]


def bucket_size(bucket_bytes: int | None) -> int:
    """The ``bucket_bytes`` every public function takes: ``None`` is :data:`DEFAULT_BUCKET_BYTES`.

    Raises:
        ValueError: ``bucket_bytes`` is not a positive int (names the value).

    Examples:
        >>> bucket_size(None) == DEFAULT_BUCKET_BYTES == 16 * 2**20, bucket_size(1024)
        (True, 1024)
    """
    if bucket_bytes is None:
        return DEFAULT_BUCKET_BYTES
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int (or None for the default, 16 MiB), "
                         f"got {bucket_bytes!r}")
    return bucket_bytes
