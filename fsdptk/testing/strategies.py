"""Hypothesis strategies for shard/gather round-trip tests.

A strategy draws a *spec*: a small picklable description (nested dicts and tuples) of a module
tree. Every rank of a :class:`~fsdptk.testing.World` rebuilds the identical module from the spec with
:func:`build_module` (on ``cpu`` or ``meta``), and :func:`random_state_dict` gives the matching full
state dict from a seed, so a test only sends the spec and a seed to the workers.

The trees mix nested ``Sequential`` / ``ModuleList`` / custom blocks; ``Linear``, ``Embedding``,
``LayerNorm``, ``RMSNorm`` and ``Conv1d`` leaves; dimensions of 1 to 7 (smaller than and not
divisible by the world size); float32 / bfloat16 / float16 parameters; persistent and
non-persistent buffers, integer buffers; and optionally a tied embedding / output projection pair.
The modules are for state round trips: their ``forward`` is not meant to compose.

Examples:
    >>> from hypothesis import given
    >>> from fsdptk.testing.strategies import module_specs, build_module, random_state_dict
    >>> @given(module_specs())
    ... def test_state_dict_round_trip(spec):
    ...     model = build_module(spec)
    ...     sd = random_state_dict(spec, seed=0)
    ...     model.load_state_dict(sd)
    ...     assert all(model.state_dict()[k].equal(v) for k, v in sd.items())
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

__all__ = [
    "module_specs",
    "build_module",
    "random_state_dict",
    "module_names",
    "TestBlock",
    "DTYPES",
]

DTYPES = ("float32", "bfloat16", "float16")
_dims = st.integers(min_value=1, max_value=7)

Spec = dict[str, Any]


class TestBlock(nn.Module):
    """A custom container with named children and extra (possibly non-persistent, integer) buffers.

    Non-persistent buffers are filled by :meth:`reset_buffers` (deterministic values derived from
    their name), which is what a model's own re-initialisation hook looks like after meta init.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, children: dict[str, nn.Module], buffers: list[tuple[Any, ...]],
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        self._nonpersistent_specs: list[tuple[str, tuple[int, ...], str]] = []
        for name, shape, dtype, persistent in buffers:
            t = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
            self.register_buffer(name, t, persistent=persistent)
            if not persistent:
                self._nonpersistent_specs.append((name, tuple(shape), dtype))
        if device is None or torch.device(device).type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers (arange-based, deterministic) on their device."""
        for name, shape, _dtype in self._nonpersistent_specs:
            buf = getattr(self, name)
            numel = 1
            for s in shape:
                numel *= s
            vals = torch.arange(numel, device=buf.device).reshape(shape) % 5
            setattr(self, name, vals.to(buf.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not composable
        return x


# ------------------------------------------------------------------------------------------
# strategies


def _leaf() -> st.SearchStrategy[Spec]:
    dtype = st.sampled_from(DTYPES)
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("linear"), "in": _dims, "out": _dims, "bias": st.booleans(), "dtype": dtype}
        ),
        st.fixed_dictionaries(
            {"type": st.just("embedding"), "num": _dims, "dim": _dims, "dtype": dtype}
        ),
        st.fixed_dictionaries({"type": st.just("layernorm"), "dim": _dims, "dtype": dtype}),
        st.fixed_dictionaries({"type": st.just("rmsnorm"), "dim": _dims, "dtype": dtype}),
        st.fixed_dictionaries(
            {"type": st.just("conv1d"), "in": _dims, "out": _dims, "k": st.integers(1, 3),
             "bias": st.booleans(), "dtype": dtype}
        ),
    )


_buffer = st.tuples(
    st.sampled_from(["buf_a", "buf_b", "buf_c"]),
    st.lists(_dims, min_size=1, max_size=2).map(tuple),
    st.sampled_from(("float32", "bfloat16", "int64", "int32")),
    st.booleans(),
)


def _container(children: st.SearchStrategy[Spec]) -> st.SearchStrategy[Spec]:
    kids = st.lists(children, min_size=1, max_size=3)
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("seq"), "children": kids}),
        st.fixed_dictionaries({"type": st.just("list"), "children": kids}),
        st.fixed_dictionaries(
            {
                "type": st.just("block"),
                "children": kids,
                "buffers": st.lists(_buffer, max_size=2, unique_by=lambda b: b[0]),  # type: ignore[index]  # a (name, shape, persistent) tuple; its strategy types it as a Collection
            }
        ),
    )


@st.composite
def module_specs(draw: st.DrawFn, *, max_leaves: int = 8, allow_tied: bool = True) -> Spec:
    """Draw a spec of a random module tree (see the module docstring for what it covers).

    Args:
        draw: supplied by hypothesis.
        max_leaves: bound on the number of leaf modules.
        allow_tied: whether a tied ``embed`` / ``head`` pair may be added at the root.

    Returns:
        dict: a picklable spec for :func:`build_module` and :func:`random_state_dict`.
    """
    tree = draw(st.recursive(_leaf(), _container, max_leaves=max_leaves))
    if tree["type"] not in ("seq", "list", "block"):
        tree = {"type": "seq", "children": [tree]}
    tied = None
    if allow_tied and draw(st.booleans()):
        tied = {"num": draw(_dims), "dim": draw(_dims), "dtype": draw(st.sampled_from(DTYPES))}
    return {"root": tree, "tied": tied}


# ------------------------------------------------------------------------------------------
# builders


def _build(node: Spec, device: torch.device | str) -> nn.Module:
    kind = node["type"]
    if kind in ("seq", "list", "block"):
        kids = [_build(c, device) for c in node["children"]]
        if kind == "seq":
            return nn.Sequential(*kids)
        if kind == "list":
            return nn.ModuleList(kids)
        return TestBlock({f"c{i}": k for i, k in enumerate(kids)}, node["buffers"], device=device)
    dtype = getattr(torch, node["dtype"])
    kw = {"device": device, "dtype": dtype}
    if kind == "linear":
        return nn.Linear(node["in"], node["out"], bias=node["bias"], **kw)
    if kind == "embedding":
        return nn.Embedding(node["num"], node["dim"], **kw)
    if kind == "layernorm":
        return nn.LayerNorm(node["dim"], **kw)
    if kind == "rmsnorm":
        return nn.RMSNorm(node["dim"], **kw)
    if kind == "conv1d":
        return nn.Conv1d(node["in"], node["out"], node["k"], bias=node["bias"], **kw)
    raise ValueError(f"unknown module type {kind!r} in spec")


class _Root(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not composable
        return x


def build_module(spec: Spec, device: torch.device | str = "cpu") -> nn.Module:
    """Build the module tree a spec describes; identical structure on every call.

    The root has a ``body`` child (the random tree) and, when the spec asks for it, ``embed``
    (``Embedding(num, dim)``) and ``head`` (``Linear(dim, num, bias=False)``) with
    ``head.weight is embed.weight``. Values are not meaningful: load :func:`random_state_dict`.

    Args:
        spec: from :func:`module_specs`.
        device: ``"cpu"`` or ``"meta"`` (or any device).

    Returns:
        nn.Module: the model.
    """
    root = _Root(_build(spec["root"], device))
    tied = spec.get("tied")
    if tied:
        dtype = getattr(torch, tied["dtype"])
        root.embed = nn.Embedding(tied["num"], tied["dim"], device=device, dtype=dtype)
        root.head = nn.Linear(tied["dim"], tied["num"], bias=False, device=device, dtype=dtype)
        root.head.weight = root.embed.weight
    return root


def module_names(spec: Spec) -> list[str]:
    """FQNs of every submodule of the built spec (``""`` for the root), in ``named_modules`` order."""
    return [name for name, _ in build_module(spec, "meta").named_modules()]


def random_state_dict(spec: Spec, seed: int) -> dict[str, torch.Tensor]:
    """A full state dict (persistent entries) for the spec's module, deterministic in ``seed``.

    Floating tensors are normal samples in their dtype, integer buffers random integers; tied keys
    map to the same tensor object, as ``state_dict()`` of a tied model does.

    Args:
        spec: from :func:`module_specs`.
        seed: the random seed.

    Returns:
        dict[str, torch.Tensor]: CPU tensors keyed like ``build_module(spec).state_dict()``.
    """
    gen = torch.Generator().manual_seed(seed)
    meta_sd = build_module(spec, "meta").state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for key, t in meta_sd.items():
        ident = id(t)
        if ident in seen:
            out[key] = seen[ident]
            continue
        if t.dtype.is_floating_point:
            val = torch.randn(t.shape, generator=gen).to(t.dtype)
        else:
            val = torch.randint(-100, 100, t.shape, generator=gen, dtype=torch.int64).to(t.dtype)
        seen[ident] = val
        out[key] = val
    return out
