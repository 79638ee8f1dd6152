"""The wire format of the engine: flat byte buffers of aligned pieces, direct pieces, buckets.

A bucket is a run of consecutive tensors whose full bytes add up to about ``bucket_bytes``. For
each bucket a rank's small pieces travel as ONE flat ``uint8`` buffer (coalescing many small
tensors into one message is what makes small models fast), each piece at a 16-byte aligned offset
so that any dtype can be viewed out of it without a copy. A piece of at least
:data:`DIRECT_MIN_BYTES` whose layout allows it travels alone, as its own message after the flat
buffer, sent from and received into its final memory (zero-copy: see :func:`is_direct`).

Transfers are pipelined two buckets deep (:class:`InFlight`): bucket k+1 is packed (or its
receive posted) while bucket k is on the wire, so a rank holds at most one extra bucket. A rank
posts each bucket's messages as one batch, receives first, so that transfers cannot block each
other on any backend (the "Point-to-point order" comment below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist

from fsdptk._core.compat import p2p_batch
from fsdptk._core.dist import comm_group
from fsdptk._core.peers import Waiter

DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024  # small enough that packing overlaps sending
# without src_rank0 no tensor moves, so the status agreement is the only collective of the data
# phase: it runs once per this many buckets (16 MiB buckets: every 256 MiB of full tensors)
LOCAL_AGREE_BUCKETS = 16
ALIGN = 16  # byte alignment of every piece inside a flat buffer (any dtype can be viewed)
# a piece this large travels as its own message, from / into its final memory (no pack, no unpack);
# smaller pieces are coalesced into the bucket's flat buffer (one message per rank and bucket)
DIRECT_MIN_BYTES = 256 * 1024


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def aligned(n: int) -> int:
    """``n`` rounded up to the piece alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packed_size(parts: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """Bytes of a flat buffer holding pieces of these ``(shape, dtype)``s."""
    return sum(aligned(nbytes(s, d)) for s, d in parts)


def pack(buf: torch.Tensor, off: int, t: torch.Tensor) -> int:
    """Copy ``t`` into ``buf`` at byte ``off``; the offset of the next piece."""
    n = t.numel() * t.element_size()
    if n:
        buf[off : off + n].view(t.dtype).view(t.shape).copy_(t)
    return off + aligned(n)


def unpack(buf: torch.Tensor | None, off: int, shape: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, int]:
    """The piece of ``shape``/``dtype`` at byte ``off`` of ``buf`` on ``device`` (a view when
    already there), and the offset of the next piece."""
    n = nbytes(shape, dtype)
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=device), off
    assert buf is not None
    t = buf[off : off + n].view(dtype).view(tuple(shape))
    if t.device != device:
        t = t.to(device)
    return t, off + aligned(n)


def is_direct(shape: Sequence[int], dtype: torch.dtype, packable_only: bool = False) -> bool:
    """Whether a piece of ``shape``/``dtype`` travels as its own message (not packed).

    Every rank decides this from the agreed metadata alone (the same answer on the sender and the
    receiver). ``packable_only`` (NF4 inner tensors, or a transport that cannot receive into the
    final memory) keeps the piece packed whatever its size.
    """
    return not packable_only and nbytes(shape, dtype) >= DIRECT_MIN_BYTES


class Refused(NamedTuple):
    """A post of a point-to-point message that raised: the error, and the peer it was for."""

    error: BaseException
    peer: int


class Post(NamedTuple):
    """One point-to-point message of a bucket, as this rank posts it."""

    recv: bool  # this rank receives it (into ``tensor``); else it sends ``tensor``
    peer: int  # the global rank at the other end
    tensor: torch.Tensor  # what is sent, or the memory the bytes land in


# ---------------------------------------------------------------------------------------------
# Point-to-point order (docs/architecture.md, "Point-to-point order")
#
# A rank may both send to and receive from another rank in one bucket (a gather to many
# destinations: writers, expert parallelism, a weight source's owners). On NCCL, transfers that
# are not grouped run one after another on the communicator's stream, and a send larger than
# NCCL's buffers does not complete until the peer's matching receive runs; two ranks that each
# post "send to the other, then receive from it" then wait for each other for ever. Gloo hides
# it (its sends never wait for the receiver). So every backend follows one rule, by construction:
#
# 1. One batch per bucket: a rank posts ALL of its messages of a bucket together
#    (:meth:`InFlight.post_all`), inside one ``ncclGroupStart`` / ``ncclGroupEnd`` where the
#    backend groups point-to-point operations (NCCL, as ``torch.distributed.batch_isend_irecv``
#    does; :func:`~fsdptk._core.compat.p2p_batch`). NCCL progresses the operations of a group
#    together, so no message of the batch waits for another.
# 2. Receives first (:func:`posting_order`): within a batch every receive is posted before any
#    send. Where a backend posts a batch's operations one by one (gloo has no grouping), posting a
#    receive never blocks, so by the time a rank posts a send, every receive it owes its peers in
#    that bucket is already posted.
# 3. Both ends derive every message from the agreed plan: the same bucket, peer, size, and order
#    per pair and direction (``collect``: :func:`~fsdptk._engine.routes.bucket_transfers`;
#    ``distribute``: only rank 0 sends). A rank waits for bucket k's transfers before it posts
#    bucket k+1's sends, and every bucket has one status agreement that every rank reaches.
#
# Why no cycle, under the worst semantics ("a send may not complete until the peer has posted
# its matching receive"; a rank posts nothing after a blocked send of an unbatched post): take the
# first bucket k in which some rank is stuck. Every rank completed bucket k-1, so every rank
# reaches bucket k and posts its receives of it (3: each matches a send of k, and nothing posted
# earlier is pending). With (1), the batch holds every operation at once and each has its match
# posted: all complete. Without grouping, (2) puts all of a rank's receives of k before its first
# send of k, so each send of k finds its receive posted and completes, and each receive of k then
# finds its send posted. Either way bucket k completes: a contradiction, so no rank is ever stuck.
# tests/test_engine.py checks this by simulating exactly the posts :func:`posting_order` and
# ``bucket_transfers`` make, over random holdings, destinations and buckets.
# ---------------------------------------------------------------------------------------------


class _Directed(Protocol):
    """Anything that says whether this rank receives it (a :class:`Post`, a planned transfer)."""

    @property
    def recv(self) -> bool: ...


P = TypeVar("P", bound=_Directed)


def posting_order(posts: Iterable[P]) -> list[P]:
    """The order in which a rank posts one bucket's messages: every receive, then every send (each
    kind in the given order, which keeps the order per pair and direction that both ends agreed).

    Examples:
        >>> from collections import namedtuple
        >>> M = namedtuple("M", "recv peer")
        >>> [(m.recv, m.peer) for m in posting_order([M(False, 1), M(True, 1), M(False, 2), M(True, 2)])]
        [(True, 1), (True, 2), (False, 1), (False, 2)]
    """
    posts = list(posts)
    return [p for p in posts if p.recv] + [p for p in posts if not p.recv]


def isend(tensor: torch.Tensor, peer: int) -> dist.Work | None:
    """Post the send of ``tensor`` to global rank ``peer`` on fsdptk's process group."""
    return dist.isend(tensor, dst=peer, group=comm_group())


def irecv(tensor: torch.Tensor, peer: int) -> dist.Work | None:
    """Post the receive of ``tensor`` from global rank ``peer`` on fsdptk's process group."""
    return dist.irecv(tensor, src=peer, group=comm_group())


class InFlight:
    """The posted point-to-point transfers of one bucket and the tensors they read or fill.

    The tensors are held until :meth:`wait` returns, so nothing a transfer touches is freed or
    reused while it is on the wire. Once the bucket's status is agreed every rank posts its part
    of the bucket unconditionally, so a wait always has a matching peer: even when a post raises
    on this rank (see :meth:`post_all`).
    """

    def __init__(self, waiter: Waiter) -> None:
        self.waiter = waiter  # the call's (see :class:`~fsdptk._core.peers.Waiter`)
        self.works: list[dist.Work] = []
        self.tensors: list[torch.Tensor] = []

    def post_all(self, posts: Iterable[Post]) -> Refused | None:
        """Post every message of a bucket as one batch, receives first (the point-to-point order
        above), and keep the tensors alive until :meth:`wait`.

        Each message is one a peer has posted (or will post) its side of, with the size every rank
        derived from the agreed metadata. So a post that raises (an I/O error where the message is
        posted, while this process lives on; a post that raises has posted nothing) does not end
        the bucket here: the message is posted again, from or into the same memory (the agreed
        size, and a receiver gets the real bytes), and so is every later one. The peers' waits then
        complete, they reach the next status agreement, and the caller reports the returned
        failure there, on every rank. Only when the second post of a message raises as well (a
        transport that refuses every post: a network failure) are the remaining messages left
        unposted.

        Returns:
            Refused | None: the first post that raised and its peer, or ``None``.
        """
        ordered = posting_order(posts)
        if not ordered:
            return None
        works: list[dist.Work] = []
        with p2p_batch(comm_group(), ordered[0].tensor.device) as batch:
            refused = self._post_each(ordered, works)
        self.works += [w for w in batch.works if w is not None] if batch.grouped else works
        return refused

    def _post_each(self, posts: list[Post], works: list[dist.Work]) -> Refused | None:
        """:meth:`post_all`'s posts, in order, each retried once when it raises; their works are
        appended to ``works``."""
        refused: Refused | None = None
        for recv, peer, t in posts:
            op: Callable[[torch.Tensor, int], dist.Work | None] = irecv if recv else isend
            try:
                work = op(t, peer)
            except Exception as exc:  # noqa: BLE001 - returned, agreed by the caller
                if refused is None:
                    refused = Refused(exc, peer)
                try:
                    work = op(t, peer)  # the peer waits for this message: post it again
                except Exception:  # noqa: BLE001 - the first error is the one reported
                    return refused
            if work is not None:  # None: this rank is not in the group (nothing was posted)
                works.append(work)
            self.tensors.append(t)
        return refused

    def wait(self, *, look_first: bool = False) -> None:
        """Wait for every posted transfer; then the tensors may be freed or read.

        With gloo the wait stops as soon as another rank reported a communication failure
        (:class:`~fsdptk._core.peers.Waiter`): a transfer to a lost peer is then left to the
        process group's timeout, in a helper thread that keeps its tensors alive, and this raises.
        """
        works, self.works = self.works, []
        self.waiter.wait(works, look_first=look_first)
        self.tensors = []

    def drain_quietly(self) -> None:
        """Wait while another exception propagates (that one is the error to report)."""
        try:
            self.wait(look_first=True)
        except Exception:  # noqa: BLE001 - the error already propagating is the one reported
            self.works, self.tensors = [], []


def buckets(sizes: Sequence[int], bucket_bytes: int, owners: Sequence[int] | None = None) -> list[list[int]]:
    """Greedy consecutive buckets of indices; a tensor larger than a bucket travels alone.

    ``owners`` (one per index: the rank that receives it) makes each bucket hold up to
    ``bucket_bytes`` for EVERY owner: the next consecutive indices of each owner, so that every
    receiver works in every bucket (and holds at most one bucket) instead of one after another.
    Indices within a bucket stay in ascending order.

    Examples:
        >>> buckets([4, 4, 4, 4], 8)
        [[0, 1], [2, 3]]
        >>> buckets([4, 4, 4, 4], 4, owners=[0, 0, 1, 1])
        [[0, 2], [1, 3]]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if owners is not None and len(set(owners)) > 1:
        return _owner_buckets(sizes, bucket_bytes, owners)
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if cur and total + n > bucket_bytes:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        out.append(cur)
    return out


def _owner_buckets(sizes: Sequence[int], bucket_bytes: int, owners: Sequence[int]) -> list[list[int]]:
    """:func:`buckets` with ``owners``: per bucket, each owner's next run of up to ``bucket_bytes``."""
    queues: dict[int, list[int]] = {}
    for i, o in enumerate(owners):
        queues.setdefault(o, []).append(i)
    heads = dict.fromkeys(queues, 0)
    out: list[list[int]] = []
    while any(heads[o] < len(q) for o, q in queues.items()):
        bucket: list[int] = []
        for o in sorted(queues):
            q, total = queues[o], 0
            while heads[o] < len(q) and (total == 0 or total + sizes[q[heads[o]]] <= bucket_bytes):
                total += sizes[q[heads[o]]] or 1  # empty tensors still count toward the run
                bucket.append(q[heads[o]])
                heads[o] += 1
        out.append(sorted(bucket))
    return out
