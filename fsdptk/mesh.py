"""Parallelism degrees -> a named DeviceMesh, and the sub-meshes FSDP, tensor parallel and expert
parallel use.

:class:`ParallelDims` holds three degrees of the dense model: ``dp_replicate`` (HSDP replica
groups), ``dp_shard`` (FSDP shard groups) and ``tp`` (tensor parallel). Their product must be the
world size; one ``dp_shard=-1`` is inferred. :meth:`ParallelDims.build_mesh` builds the mesh once
and then :attr:`~ParallelDims.fsdp_mesh` / :attr:`~ParallelDims.tp_mesh` hand out the right slices.

A fourth degree, ``ep`` (expert parallel), borrows ranks from data and tensor parallelism, as
transformers and torchtitan do: the ``dp_shard * tp`` ranks of one replica are seen a second way,
as ``efsdp`` groups of ``ep`` ranks. The ``ep`` ranks of a group hold different experts (together
all of them) and exchange tokens; the ``efsdp = dp_shard * tp / ep`` ranks at the same position
of every group hold the same experts and FSDP-shard them between each other. With ``ep > 1``
:meth:`~ParallelDims.build_mesh` also builds this expert mesh (``dp_replicate``, ``efsdp``,
``ep``), handed out by :attr:`~ParallelDims.ep_mesh` and :attr:`~ParallelDims.expert_fsdp_mesh`.
``ep`` is innermost and a multiple of ``tp``, so an EP group is whole TP groups (ranks that share a
batch) side by side. Example, 8 ranks, ``dp_shard=4, tp=2, ep=4``::

    rank            0    1    2    3    4    5    6    7
    dense  dp_shard 0    0    1    1    2    2    3    3      (tp: 0 1 0 1 ...)
    expert ep       0    1    2    3    0    1    2    3      experts E0-1 E2-3 E4-5 E6-7 E0-1 ...
           efsdp    0    0    0    0    1    1    1    1      (ranks 0 and 4 shard E0-1 between them)

Mesh layout (outermost to innermost, as torchtitan): ``dp_replicate``, ``dp_shard``, ``tp``. TP is
innermost so that its ranks are adjacent (the same host), where its many small collectives are
cheapest; replicas are outermost so that the rarer HSDP all-reduce crosses hosts.

Which dims the mesh has:
    - ``dp_replicate`` and ``tp`` only when their degree is > 1;
    - ``dp_shard`` always, even with degree 1: FSDP needs a shard dim to run over, so a
      replicate-only (DDP-like HSDP with shards of size 1) or a TP-only layout still composes with
      ``shard_model``, and an all-ones layout is a 1-D mesh of size 1 named ``dp_shard``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdptk._core.dist import has_process_group, log_rank0, world

__all__ = ["ParallelDims"]

_log = logging.getLogger(__name__)

_DIM_ORDER = ("dp_replicate", "dp_shard", "tp")
_EXPERT_DIM_ORDER = ("dp_replicate", "efsdp", "ep")


def _check_degree(name: str, value: object, *, allow_infer: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value >= 1 or (allow_infer and value == -1):
        return
    allowed = ">= 1 or -1 (inferred)" if allow_infer else ">= 1"
    raise ValueError(f"{name} must be {allowed}, got {value}")


@dataclass
class ParallelDims:
    """Degrees of data parallelism (replicate x shard), tensor parallelism and expert parallelism.

    ``dp_replicate * dp_shard * tp`` must equal the world size. ``dp_shard=-1`` (the default) takes
    whatever the other degrees leave. After construction every degree is a positive int.
    ``ep`` (keyword only, so positional calls of the three dense degrees keep their meaning) takes
    no ranks of its own: it must divide ``dp_shard * tp`` and be a multiple of ``tp`` (see the
    module docstring); it must also divide each MoE layer's number of experts, which
    :func:`fsdptk.apply_ep` checks.

    Args:
        dp_replicate: number of HSDP replica groups (1: plain FSDP).
        dp_shard: ranks each parameter is sharded over; ``-1`` infers it from the others.
        tp: tensor-parallel degree.
        world_size: total number of ranks; ``None`` reads it from the default process group (1 when
            there is none).
        ep: expert-parallel degree: ranks that hold different experts and exchange tokens
            (1: every rank holds every expert, FSDP-sharded like the dense parameters).

    Raises:
        TypeError: when a degree is not an int.
        ValueError: when a degree is < 1 (other than ``dp_shard=-1``), when ``dp_shard=-1`` cannot
            be inferred exactly, when the product is not the world size, or when ``ep`` does not
            divide ``dp_shard * tp`` or is not a multiple of ``tp``; the message names the numbers.

    Examples:
        >>> from fsdptk import ParallelDims
        >>> dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
        >>> (dims.dp_replicate, dims.dp_shard, dims.tp)
        (2, 2, 2)
        >>> dims.mesh_shape, dims.mesh_dim_names
        ((2, 2, 2), ('dp_replicate', 'dp_shard', 'tp'))
        >>> ParallelDims(dp_shard=3, world_size=4)
        Traceback (most recent call last):
        ...
        ValueError: dp_replicate (1) * dp_shard (3) * tp (1) = 3 != world size (4)
        >>> dims = ParallelDims(dp_shard=4, ep=2, world_size=4)
        >>> dims.efsdp, dims.expert_mesh_dim_names, dims.expert_mesh_shape
        (2, ('efsdp', 'ep'), (2, 2))
        >>> ParallelDims(dp_shard=2, tp=2, ep=3, world_size=4)
        Traceback (most recent call last):
        ...
        ValueError: ep (3) must divide dp_shard * tp (2 * 2 = 4): expert parallelism borrows the ranks of data and tensor parallelism
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int | None = None
    ep: int = field(default=1, kw_only=True)
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_degree("dp_replicate", self.dp_replicate, allow_infer=False)
        _check_degree("dp_shard", self.dp_shard, allow_infer=True)
        _check_degree("tp", self.tp, allow_infer=False)
        if self.world_size is None:
            self.world_size = world()[0]
        _check_degree("world_size", self.world_size, allow_infer=False)
        degrees = (
            f"dp_replicate ({self.dp_replicate}) * dp_shard ({self.dp_shard}) * tp ({self.tp})"
        )
        if self.dp_shard == -1:
            others = self.dp_replicate * self.tp
            if self.world_size % others:
                raise ValueError(
                    f"cannot infer dp_shard: world size ({self.world_size}) is not divisible by "
                    f"{degrees.replace(' * dp_shard (-1)', '')} = {others}"
                )
            self.dp_shard = self.world_size // others
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ValueError(f"{degrees} = {product} != world size ({self.world_size})")
        _check_degree("ep", self.ep, allow_infer=False)
        borrowed = self.dp_shard * self.tp
        if borrowed % self.ep:
            raise ValueError(
                f"ep ({self.ep}) must divide dp_shard * tp ({self.dp_shard} * {self.tp} = "
                f"{borrowed}): expert parallelism borrows the ranks of data and tensor parallelism")
        if self.ep > 1 and self.ep % self.tp:
            raise ValueError(
                f"ep ({self.ep}) must be a multiple of tp ({self.tp}): the ranks of a TP group "
                "share one batch, so an expert-parallel group holds whole TP groups")

    # -- facts --------------------------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        """Number of data-parallel ranks (``dp_replicate * dp_shard``): divide the batch by it."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp_enabled(self) -> bool:
        """True when FSDP runs as HSDP (``dp_replicate > 1``): its mesh is 2-D."""
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        """True when ``tp > 1``."""
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        """True when ``ep > 1``: experts are sharded over the expert mesh."""
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them (``dp_shard * tp // ep``)."""
        return self.dp_shard * self.tp // self.ep

    @property
    def expert_mesh_dim_names(self) -> tuple[str, ...]:
        """The expert mesh's dims, outermost first: ``dp_replicate`` (when > 1), ``efsdp``, ``ep``."""
        return tuple(n for n in _EXPERT_DIM_ORDER if n != "dp_replicate" or self.dp_replicate > 1)

    @property
    def expert_mesh_shape(self) -> tuple[int, ...]:
        """Sizes of :attr:`expert_mesh_dim_names`, in the same order."""
        return tuple(getattr(self, n) for n in self.expert_mesh_dim_names)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The dims :meth:`build_mesh` creates, outermost first (see the module docstring)."""
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        return tuple(n for n in _DIM_ORDER if n == "dp_shard" or sizes[n] > 1)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of :attr:`mesh_dim_names`, in the same order."""
        return tuple(getattr(self, n) for n in self.mesh_dim_names)

    # -- the mesh -----------------------------------------------------------------------------
    def build_mesh(self, device_type: str = "cuda") -> DeviceMesh:
        """Build (once) and return the world DeviceMesh with named dims.

        Collective: every rank must call it. A second call returns the same mesh.

        Args:
            device_type: ``"cuda"``, ``"cpu"``, ... the device type of the mesh.

        Returns:
            DeviceMesh: shape :attr:`mesh_shape`, dims :attr:`mesh_dim_names`.

        Raises:
            RuntimeError: when no default process group is initialised.
            ValueError: when the process group's world size is not :attr:`world_size`, or when the
                mesh was already built for another device type.

        Examples:
            >>> dims = ParallelDims(dp_replicate=2, dp_shard=2)  # needs a 4-rank group; tests/test_mesh.py runs it  # doctest: +SKIP
            >>> mesh = dims.build_mesh("cuda")  # needs a 4-rank group; tests/test_mesh.py runs it  # doctest: +SKIP
            >>> mesh.mesh_dim_names  # needs a 4-rank group; tests/test_mesh.py runs it  # doctest: +SKIP
            ('dp_replicate', 'dp_shard')
        """
        if self._mesh is not None:
            if self._mesh.device_type != device_type:
                raise ValueError(
                    f"the mesh was already built for device type {self._mesh.device_type!r}, "
                    f"not {device_type!r}"
                )
            return self._mesh
        if not has_process_group():
            raise RuntimeError(
                "ParallelDims.build_mesh needs an initialised default process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up the environment)"
            )
        pg_size = world()[0]
        if pg_size != self.world_size:
            raise ValueError(
                f"the process group has {pg_size} ranks but ParallelDims was built for world size "
                f"{self.world_size} (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, "
                f"tp={self.tp})"
            )
        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        if self.ep_enabled:  # the same ranks in the same order, seen as (replicate, efsdp, ep)
            self._expert_mesh = init_device_mesh(device_type, self.expert_mesh_shape,
                                                 mesh_dim_names=self.expert_mesh_dim_names)
            log_rank0(_log, "Built %s expert mesh %s with dims %s", device_type,
                      self.expert_mesh_shape, self.expert_mesh_dim_names)
        self._mesh = mesh
        log_rank0(_log, "Built %s device mesh %s with dims %s", device_type, self.mesh_shape,
                  self.mesh_dim_names)
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh from :meth:`build_mesh`; RuntimeError when it was not built yet."""
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) before using its meshes")
        return self._mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh to pass to ``shard_model(dp_mesh=...)`` / ``fully_shard(mesh=...)``.

        1-D ``dp_shard`` for FSDP, 2-D ``(dp_replicate, dp_shard)`` for HSDP (FSDP2 replicates over
        dim 0 and shards over dim 1).
        """
        if self.hsdp_enabled:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D ``tp`` mesh for tensor parallel; ValueError when ``tp == 1``."""
        if not self.tp_enabled:
            raise ValueError(
                f"there is no TP mesh: tp=1 (dp_replicate={self.dp_replicate}, "
                f"dp_shard={self.dp_shard}); check ParallelDims.tp_enabled first"
            )
        return self.mesh["tp"]

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The expert mesh (:attr:`expert_mesh_dim_names`) that :meth:`build_mesh` built beside the
        dense one; ValueError when ``ep == 1``."""
        if not self.ep_enabled:
            raise ValueError(
                f"there is no expert mesh: ep=1 (dp_replicate={self.dp_replicate}, "
                f"dp_shard={self.dp_shard}, tp={self.tp}); check ParallelDims.ep_enabled first")
        if self._expert_mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) before using its meshes")
        return self._expert_mesh

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The 1-D ``ep`` mesh: pass it to :func:`fsdptk.apply_ep`. ValueError when ``ep == 1``."""
        return self.expert_mesh["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh the experts are FSDP-sharded over: pass it to ``shard_model(expert_dp_mesh=...)``.

        1-D ``efsdp``, or 2-D ``(dp_replicate, efsdp)`` with HSDP. ValueError when ``ep == 1``.
        """
        mesh = self.expert_mesh
        if self.hsdp_enabled:
            return mesh["dp_replicate", "efsdp"]
        return mesh["efsdp"]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the :attr:`dp_degree` data-parallel ranks (for data sampling)."""
        mesh = self.mesh
        rank = mesh.get_local_rank("dp_shard")
        if self.hsdp_enabled:
            rank += mesh.get_local_rank("dp_replicate") * self.dp_shard
        return rank
