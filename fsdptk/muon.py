"""``fsdptk.Muon``: ``torch.optim.Muon``'s exact step for sharded models (FSDP2, HSDP, FSDP x TP,
expert parallelism), each matrix orthogonalized once, on one owner rank.

Muon's update orthogonalizes the whole momentum matrix with Newton-Schulz iterations
(``torch.optim._muon._zeropower_via_newtonschulz``), so it cannot run on a shard. Everything else
is elementwise (the momentum ``lerp``, Nesterov's ``lerp``, the ``bfloat16`` cast Newton-Schulz
starts with, the weight decay and the update itself) and runs on each rank's local shard, where it
gives the same bits as on the full tensor. The step, on every rank:

1. Agree (one object exchange): which parameters have a gradient, their shapes, dtypes and
   hyper-parameters, every rank's error; and, when they changed, every rank's boxes of every
   parameter, from which every rank derives the same plan (:mod:`fsdptk._plans.muon_plan`): each
   matrix's owner, spread by Newton-Schulz work, and each bucket's messages.
2. Per bucket: each holder computes its piece of the Newton-Schulz input (``bfloat16``) and sends
   it to the owner, point to point; each owner orthogonalizes its full matrices with torch's own
   function and sends every holder (each replica) its piece of the result. A rank posts each of
   the two exchanges of a bucket as one batch, receives first (:mod:`fsdptk._engine.wire`'s
   point-to-point order); the bucket's status is agreed before its bytes move.
3. One last status agreement, then the local, elementwise apply: the momentum buffer, the weight
   decay and the update, exactly torch's operations. A failure on any rank in steps 1-2 raises on
   every rank and nothing is changed: no parameter and no momentum buffer is half-stepped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdptk._core.compat import local_tensor, muon_adjust_lr, muon_zeropower, optim_to_scalar
from fsdptk._core.dist import all_gather_object, comm_device, error_payload, host_key, raise_if_any
from fsdptk._core.dist import raise_lowest as _raise_lowest
from fsdptk._core.dist import world as _world
from fsdptk._engine.agree import Status, fingerprint
from fsdptk._engine.layouts import Box, box_shape, dtensor_box, full_box
from fsdptk._engine.owners import owner_round
from fsdptk._engine.wire import DEFAULT_BUCKET_BYTES
from fsdptk._plans.muon_plan import WIRE_DTYPE, MuonPlan, bucket_view, plan_step

__all__ = ["Muon"]

_HYPER = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")


@dataclass(frozen=True)
class _StepView:
    """What each rank sends in a step's first exchange."""

    fingerprint: str | None  # of the parameters with a gradient (positions, shapes, dtypes, kinds, hyper-parameters)
    key: str | None  # of this rank's boxes and host: whether the plan agreed before is still current
    error: tuple[str, str, str] | None  # error_payload of this rank's failure, or None


@dataclass(frozen=True)
class _HoldingsView:
    """What each rank sends when the plan must be made (anew): its boxes and its host."""

    boxes: list[Box | None]  # per parameter with a gradient, the box of the full parameter it holds
    host: str  # its host (a replica on the owner's host sends)


@dataclass
class _Item:
    """This rank's view of one parameter with a gradient (local; never crosses ranks)."""

    group: dict[str, Any]  # its param group
    param: torch.Tensor  # the parameter (a DTensor or a plain tensor)
    local: torch.Tensor  # its local tensor
    grad: torch.Tensor  # its gradient's local tensor
    buf: torch.Tensor | None  # its momentum buffer's local tensor (None before the first step)
    box: Box | None  # the box of the full parameter this rank holds (None: none)


def _name(group: dict[str, Any], gi: int, pi: int) -> str:
    names = group.get("param_names")
    return repr(names[pi]) if names else f"parameter {pi} of param group {gi}"


def _param_problem(p: torch.Tensor) -> str | None:
    """Why Muon cannot optimize ``p`` (the message's end), or None."""
    if p.is_sparse or p.layout != torch.strided:
        return f"is sparse (layout {p.layout}): Muon does not support sparse parameters"
    if torch.is_complex(p):
        return f"is complex ({p.dtype}): Muon does not support complex parameters"
    if p.ndim not in (2, 3):
        return (f"has shape {list(p.shape)} ({p.ndim}-D): Muon orthogonalizes 2-D matrices and fused "
                "(E, a, b) expert tensors (3-D) only; give norms, biases, embeddings and the output head "
                "to AdamW (see docs/muon.md)")
    return None


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for sharded parameters: the same arguments, defaults and state, and,
    given the same gradients, the same parameters and momentum buffers bit for bit.

    Parameters may be plain 2-D tensors, DTensors of any placements FSDP2, HSDP, FSDP x TP and
    :func:`fsdptk.apply_ep` give (``Shard``, ``_StridedShard``, ``Replicate`` over 1 to 3 mesh
    dims), and fused expert tensors: a 3-D parameter is taken as ``E`` experts of shape
    ``(a, b)``, each orthogonalized on its own and its learning rate adjusted by ``(a, b)``, as
    if each expert were its own parameter. Each matrix's Newton-Schulz iterations run once, on
    one owner rank, over the full matrix: the shards travel point to point to the owner and the
    result travels back (never an all-gather to every rank). Plain tensors count as replicated on
    every rank (an unsharded module, DDP): one rank orthogonalizes, every rank gets the result.

    The state is ``torch.optim.Muon``'s: ``{"momentum_buffer": tensor}`` per parameter, a DTensor
    sharded like the parameter, so :func:`fsdptk.get_full_optimizer_state_dict`,
    :func:`fsdptk.load_from_full_optimizer_state_dict` and :mod:`fsdptk.dcp` work on it, and a
    full state dict of 2-D parameters loads into a single-process ``torch.optim.Muon``.

    Construction and :meth:`step` are collective when a process group is initialized (every rank
    calls them, in the same order): an error on any rank is raised on every rank, and a failed
    step changes nothing. See ``docs/muon.md``.

    Args:
        params: parameters or param groups (as every torch optimizer; named parameters too).
        lr: learning rate.
        weight_decay: decoupled weight decay.
        momentum: momentum factor.
        nesterov: Nesterov momentum.
        ns_coefficients: the ``(a, b, c)`` of the Newton-Schulz polynomial.
        eps: added to the norm before the first iteration.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None`` / ``"original"`` (``sqrt(max(1, a / b))``), ``"match_rms_adamw"``
            (``0.2 * sqrt(max(a, b))``), or any other rule the installed ``torch.optim.Muon``
            accepts.

    Raises:
        ValueError: on every rank, a hyper-parameter ``torch.optim.Muon`` refuses (its message),
            or parameters that are neither 2-D nor 3-D, complex or sparse (each named, with its
            shape).

    Examples:
        >>> import copy, torch
        >>> from fsdptk import Muon
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> twin = copy.deepcopy(model)
        >>> opt = Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
        >>> adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=3e-4)
        >>> ref = torch.optim.Muon([p for p in twin.parameters() if p.ndim == 2], lr=0.02)
        >>> x = torch.randn(3, 8)
        >>> model(x).square().sum().backward(); twin(x).square().sum().backward()
        >>> opt.step(); adamw.step(); ref.step()
        >>> all(torch.equal(a, b) for a, b in zip(model[0].weight, twin[0].weight))
        True
        >>> sorted(opt.state_dict()["state"][0])
        ['momentum_buffer']
        >>> Muon([model[0].bias])
        Traceback (most recent call last):
        ...
        ValueError: Muon cannot optimize 1 parameter(s): parameter 0 of param group 0 has shape [16] (1-D): ...
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr_fn": adjust_lr_fn}
        self._plan: tuple[tuple[str | None, ...], MuonPlan] | None = None
        self._bucket_bytes = DEFAULT_BUCKET_BYTES
        error: Exception | None = None
        try:
            torch.optim.Muon([torch.empty(1, 1)], **defaults)  # type: ignore[arg-type]  # torch's own checks and messages
            super().__init__(params, defaults)
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            error = e
        raise_if_any(error)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as every torch optimizer), refusing parameters Muon cannot
        optimize: each named, with its shape.

        Raises:
            ValueError: a parameter is neither 2-D nor 3-D, or is complex or sparse.
        """
        gi = len(self.param_groups)
        params = param_group["params"]
        if isinstance(params, set):  # torch refuses sets with its own message
            return super().add_param_group(param_group)
        if not isinstance(params, torch.Tensor):
            params = list(params)  # (a generator is read once: the group keeps the list)
            param_group = {**param_group, "params": params}
        else:
            params = [params]
        names = param_group.get("param_names")
        if names is None and params and isinstance(params[0], tuple):
            names = [n for n, _ in params]
        problems = []
        for pi, p in enumerate(params):
            t = p[1] if isinstance(p, tuple) else p
            why = _param_problem(t) if isinstance(t, torch.Tensor) else None
            if why:
                problems.append(f"{repr(names[pi]) if names else f'parameter {pi} of param group {gi}'} {why}")
        if problems:
            raise ValueError(f"Muon cannot optimize {len(problems)} parameter(s): " + "; ".join(problems))
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step over every parameter with a gradient (collective: every rank calls it).

        Args:
            closure: re-evaluates the model and returns the loss (as every torch optimizer).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: a sparse gradient (torch's message), or the communication failed.
            ValueError: ranks disagree on which parameters have gradients, their shapes or the
                hyper-parameters, or a gradient is not laid out like its parameter.
            Exception: any rank's failure, on every rank; nothing was changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items: list[_Item] = []
        error: Exception | None = None
        fp = key = None
        try:
            items = self._items()
            fp = fingerprint(self._rows(items))
            key = fingerprint([(fp, host_key()), *((it.box,) for it in items)])
        except Exception as e:  # noqa: BLE001 - agreed just below
            error = e
        plan = self._agree(items, _StepView(fingerprint=fp, key=key, error=error_payload(error)), error)
        if items:
            results = self._exchange(items, plan)
            self._apply(items, results)
        return loss

    # -----------------------------------------------------------------------------------------
    # the step's parts

    def _items(self) -> list[_Item]:
        """This rank's parameters with a gradient, in group order (local; raises its problem)."""
        items = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                if isinstance(g, DTensor) != isinstance(p, DTensor) or g.shape != p.shape or (
                        isinstance(p, DTensor) and (g.placements != p.placements or g.device_mesh != p.device_mesh)):
                    raise ValueError(f"the gradient of {_name(group, gi, pi)} ({_describe(g)}) is not laid out "
                                     f"like the parameter ({_describe(p)})")
                buf = self.state[p].get("momentum_buffer")
                box = _held_box(p)
                items.append(_Item(group=group, param=p, local=local_tensor(p), grad=local_tensor(g),
                                   buf=None if buf is None else local_tensor(buf), box=box))
        return items

    def _rows(self, items: Sequence[_Item]) -> list[tuple[Any, ...]]:
        """What every rank must agree on: per parameter with a gradient its position, shape,
        dtype, kind and hyper-parameters."""
        where = {id(p): (gi, pi) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])}
        return [(where[id(it.param)], tuple(it.param.shape), str(it.param.dtype), type(it.param).__name__,
                 tuple(_plain(it.group[k]) for k in _HYPER)) for it in items]

    def _agree(self, items: list[_Item], view: _StepView, error: Exception | None) -> MuonPlan:
        """The step's agreement: every rank's error raised on every rank, the same parameters on
        every rank, and the plan (made anew when a rank's boxes changed)."""
        views: list[_StepView] = all_gather_object(view)
        _raise_lowest([v.error for v in views], error)
        diff = [r for r, v in enumerate(views) if v.fingerprint != views[0].fingerprint]
        if diff:
            raise ValueError(f"Muon.step: the parameters with a gradient (positions, shapes, dtypes) or the "
                             f"hyper-parameters differ between rank 0 and ranks {diff}: every rank must step the "
                             "same parameters with the same hyper-parameters")
        keys = tuple(v.key for v in views)
        if self._plan is None or self._plan[0] != keys:
            held: list[_HoldingsView] = all_gather_object(
                _HoldingsView(boxes=[it.box for it in items], host=host_key()))
            plan = plan_step([tuple(it.param.shape) for it in items], [h.boxes for h in held],
                             [h.host for h in held], bucket_bytes=self._bucket_bytes)
            self._plan = (keys, plan)
        return self._plan[1]

    def _exchange(self, items: list[_Item], plan: MuonPlan) -> list[torch.Tensor]:
        """Every parameter's local piece of its orthogonalized update (``bfloat16``), computed
        without changing anything; raises on every rank when any rank failed."""
        status = Status("Muon.step")
        out: list[torch.Tensor] = []
        try:
            try:
                out = [torch.empty(it.local.shape, dtype=WIRE_DTYPE, device=it.local.device) for it in items]
            except Exception as exc:  # noqa: BLE001 - agreed at the first bucket
                status.fail(exc, "allocating the updates")
            world, rank = _world()
            owner_round((bucket_view(plan, b, rank) for b in plan.buckets), _MuonWork(items, plan, out, rank),
                        status, comm_device() if world > 1 else torch.device("cpu"))
            status.agree()
        finally:
            status.waiter.close()
        return out

    def _apply(self, items: list[_Item], results: list[torch.Tensor]) -> None:
        """torch.optim.Muon's elementwise operations on the local tensors, in its order."""
        for it, update in zip(items, results):
            group = it.group
            lr = optim_to_scalar(group["lr"])
            state = self.state[it.param]
            if "momentum_buffer" not in state:
                grad = it.param.grad
                assert grad is not None, "only parameters with a gradient are stepped"
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            local_tensor(state["momentum_buffer"]).lerp_(it.grad, 1 - group["momentum"])
            adjusted_lr = muon_adjust_lr(lr, group["adjust_lr_fn"], torch.Size(it.param.shape[-2:]))
            it.local.mul_(1 - lr * group["weight_decay"])
            it.local.add_(update, alpha=-adjusted_lr)


def _plain(v: Any) -> Any:
    """A hyper-parameter as a comparable plain value (a tensor learning rate as its float)."""
    return float(v) if isinstance(v, torch.Tensor) else v


def _describe(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return f"DTensor {list(t.shape)} {t.placements} on mesh {t.device_mesh.mesh_dim_names}"
    return f"tensor {list(t.shape)}"


def _held_box(p: torch.Tensor) -> Box | None:
    """The box of the full parameter this rank holds (None: none, or an empty one)."""
    if isinstance(p, DTensor):
        if p.device_mesh.get_coordinate() is None:
            return None
        box = dtensor_box(p)
    else:
        box = full_box(p.shape)
    return None if 0 in box_shape(box) else box


class _MuonWork:
    """One step's owner round (:func:`fsdptk._engine.owners.owner_round`): the matrices'
    Newton-Schulz inputs, torch's Newton-Schulz, and where each rank's piece of a result goes."""

    dtype = WIRE_DTYPE

    def __init__(self, items: list[_Item], plan: MuonPlan, out: list[torch.Tensor], rank: int) -> None:
        self.items, self.plan, self.out, self.rank = items, plan, out, rank

    def shape(self, i: int) -> tuple[int, ...]:
        return self.plan.matrices[i].shape

    def device(self, i: int) -> torch.device:
        return self.items[self.plan.matrices[i].param].local.device

    def _local(self, i: int) -> tuple[_Item, tuple[int, ...]]:
        piece = self.plan.pieces[self.rank][i]
        assert piece is not None, "a planned piece is held"
        return self.items[self.plan.matrices[i].param], piece.local

    def piece(self, i: int) -> torch.Tensor:
        """This rank's piece of matrix ``i``'s Newton-Schulz input: torch's momentum and Nesterov
        ``lerp`` (out of place: nothing changes before the step is agreed) and its cast."""
        it, at = self._local(i)
        group = it.group
        grad = it.grad[at]
        buf = it.buf[at] if it.buf is not None else torch.zeros_like(grad)
        buf = buf.lerp(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        return update.to(WIRE_DTYPE)

    def compute(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """torch's Newton-Schulz over the full matrix ``i`` (its param group's coefficients)."""
        group = self.items[self.plan.matrices[i].param].group
        return muon_zeropower(full, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def store(self, i: int, piece: torch.Tensor) -> None:
        """This rank's piece of matrix ``i``'s result into its parameter's local update."""
        m = self.plan.matrices[i]
        self.out[m.param][self._local(i)[1]].copy_(piece)
