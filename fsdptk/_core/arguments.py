"""Arguments agreed: every per-rank argument of a collective call that changes what the ranks
exchange is compared across ranks in the call's first exchange, before any file is opened for
writing, any model changes or any tensor moves (internal; built on :mod:`fsdptk._core.dist`).

A call either runs :func:`agree_arguments` first (one small object all-gather), or folds its
:func:`arguments_view` into its own first object exchange and runs :func:`check_arguments` on
every rank's view. Ranks that differ get, on every rank, one ValueError naming each differing
argument and every rank's value (``save_safetensors: the ranks disagree on writers: rank 0 passed
2, rank 1 passed 1; every rank must pass the same value``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from fsdptk._core.dist import all_gather_object, world

__all__ = ["ArgumentsView", "agree_arguments", "arguments_view", "check_arguments", "describe"]


class ArgumentsView(NamedTuple):
    """What each rank says about the arguments of one collective call, in the call's first exchange."""

    call: str  # the public call, for the message ("save_safetensors")
    values: tuple[tuple[str, str], ...]  # (argument, describe(value)), in the caller's order


def describe(value: Any) -> str:
    """An argument as a string that is the same on every rank for the same value: scalars by
    ``repr``, dtypes and devices as strings, paths resolved, dataclasses (``ParallelDims``) by their
    fields, containers item by item, callables by qualified name, anything else by ``repr``
    without memory addresses; over 300 characters, a head and a digest. Never raises.

    Examples:
        >>> describe(torch.bfloat16), describe(None), describe("5GB"), describe(len)
        ('torch.bfloat16', 'None', "'5GB'", 'builtins.len')
    """
    try:
        if value is None or isinstance(value, (bool, int, float, str)):
            out = repr(value)
        elif isinstance(value, (torch.dtype, torch.device)):
            out = str(value)
        elif isinstance(value, os.PathLike):
            out = repr(os.path.realpath(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out = type(value).__qualname__ + "(" + ", ".join(
                f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value) if f.repr) + ")"
        elif isinstance(value, Mapping):
            out = "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in value.items()) + "}"
        elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            out = "[" + ", ".join(describe(v) for v in value) + "]"
        elif callable(value) and hasattr(value, "__qualname__"):
            out = f"{getattr(value, '__module__', None) or '?'}.{value.__qualname__}"
        else:
            out = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
    except Exception:  # noqa: BLE001 - a description never fails the agreement itself
        out = f"<{type(value).__qualname__}>"
    return out if len(out) <= 300 else f"{out[:240]}... (sha256 {hashlib.sha256(out.encode()).hexdigest()[:16]})"


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0, 2``, ``ranks 0-3, 6``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(
        f"{g[0]}-{g[-1]}" if len(g) > 2 else ", ".join(map(str, g)) for g in runs)


def check_arguments(views: Sequence[ArgumentsView]) -> None:
    """From every rank's view (no collective): one ValueError naming each argument the ranks
    disagree on and every rank's value; nothing when they agree.

    Examples:
        >>> view = lambda w: ArgumentsView("save_safetensors", (("writers", describe(w)),))
        >>> check_arguments([view(2), view(1)])
        Traceback (most recent call last):
        ValueError: save_safetensors: the ranks disagree on writers: rank 0 passed 2, rank 1 passed 1; every rank must pass the same value
    """
    def who(values: list[str]) -> str:
        return ", ".join(f"{_ranks([r for r, v in enumerate(values) if v == value])} passed {value}"
                         for value in dict.fromkeys(values))

    calls = [v.call for v in views]
    if len(set(calls)) > 1:
        raise ValueError(f"the ranks are in different fsdptk calls: {who(calls).replace('passed', 'in')}; "
                         "every rank must make the same collective calls in the same order")
    given = [dict(v.values) for v in views]
    clauses = [f"{name}: {who(values)}" for name in dict.fromkeys(k for d in given for k in d)
               if len(set(values := [d.get(name, "<nothing>") for d in given])) > 1]
    if clauses:
        raise ValueError(f"{calls[0]}: the ranks disagree on {'; on '.join(clauses)}; every rank must pass "
                         f"the same value{'s' if len(clauses) > 1 else ''}")


def agree_arguments(call: str, **arguments: Any) -> None:
    """Agree a collective call's per-rank arguments before anything moves: one small object
    all-gather (none in one process); ranks that differ get, on every rank, one ValueError naming
    each differing argument and every rank's value. Collective: first in the call, on every rank.

    Args:
        call: the public call, for the message (``"save_safetensors"``).
        **arguments: those that change what the ranks exchange, compared through :func:`describe`
            (pass the form that must be equal: ``dims`` resolved, a device's type).

    Raises:
        ValueError: ``"<call>: the ranks disagree on <name>: rank 0 passed <a>, rank 1 passed <b>;
            every rank must pass the same value"``, on every rank (see :func:`check_arguments`).

    Examples:
        >>> agree_arguments("save_safetensors", writers=1)  # one process: nothing to agree
    """
    if world()[0] > 1:
        check_arguments(all_gather_object(arguments_view(call, **arguments)))


def arguments_view(call: str, **arguments: Any) -> ArgumentsView:
    """This rank's :class:`ArgumentsView` (to fold into a call's own first object exchange, then
    :func:`check_arguments` on every rank's)."""
    return ArgumentsView(call=call, values=tuple((k, describe(v)) for k, v in arguments.items()))
