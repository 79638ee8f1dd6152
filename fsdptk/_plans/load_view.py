"""A load's source views, composed in one place, top to bottom.

Every load of model state reads its values through the same stack of engine source views
(:mod:`fsdptk._engine.sources`), each seeing the one below under other keys::

    file or Mapping            the caller's full_sd, or a SafetensorsCheckpoint
      -> conversion or rename  the checkpoint under the (base) model's keys: transformers' or the
                               declared rules (per-box trees), or an explicit rename
      -> PEFT base keys        a base checkpoint under a PEFT model's keys (``base_layer`` levels)
      -> aliases               a tied group read under its canonical key

:func:`compose` builds that stack for :func:`fsdptk.load_from_full_model_state_dict` and
:func:`fsdptk.load_safetensors` alike (the second only adds the file's rename or conversion), so
the path of a load descends from the public call through here to the engine. The conversion of a
PEFT model is resolved against its base model, under the base model's keys, so a Hub-layout
checkpoint (per-expert tensors, renamed keys) loads into a wrapped model as into the bare one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from torch import nn

from fsdptk._engine.sources import RenamedSource, aliased, as_source
from fsdptk._engine.sources.convert import ConvertedSource, Leaf
from fsdptk._files.common import Rename, rename_keys
from fsdptk._plans import peft as _peft
from fsdptk.conversions import resolve_load
from fsdptk.errors import ConversionError

__all__ = ["LoadView", "compose"]


class LoadView(NamedTuple):
    """The composed views of one load."""

    source: RenamedSource  # under the model's keys, tied aliases folded: what the engine reads
    viewed: Mapping[str, Any]  # below the aliases (a PEFT view knows the adapter keys it left out)
    total: int  # bytes a full read of the file takes (the progress bar's total; 0 for a Mapping)


def _base_model_and_shapes(model: nn.Module) -> tuple[nn.Module, dict[str, tuple[int, ...]] | None]:
    """The model a conversion is resolved against and its keys' shapes (``None``: its own
    ``state_dict``): a PEFT model's base model under the base checkpoint's keys."""
    names = _peft.base_names(model)
    if names is None:
        return model, None
    to_base, _ = names
    sd = model.state_dict(keep_vars=True)
    base = _peft.base_model(model)
    return base, {b: tuple(sd[k].shape) for k, b in to_base.items()}


def _counting(nbytes: Callable[[str], int], on_read: Callable[[int], None] | None
              ) -> Callable[..., None] | None:
    """A read hook counting each file key's bytes once (progress), or ``None``."""
    if on_read is None:
        return None
    seen: set[str] = set()

    def count(key: str, *_box: Any) -> None:
        if key not in seen:
            seen.add(key)
            on_read(nbytes(key))

    return count


def _file_view(model: nn.Module, mapping: Mapping[str, Any], rename: Rename, conversion: Any,
               on_read: Callable[[int], None] | None) -> tuple[Mapping[str, Any], int]:
    """The file under the (base) model's keys: through ``rename`` when given, else through
    ``conversion`` when it converts anything, else as it is; and the bytes a full read takes."""
    nbytes = getattr(mapping, "nbytes", None)
    if rename is not None or conversion is None or not mapping:
        names: dict[str, str] = {}
        # the view reports model keys: each counts its file key's bytes once
        count = None if nbytes is None else _counting(lambda key: nbytes(names[key]), on_read)
        names.update(rename_keys(list(mapping), rename, what="checkpoint key"))
        if nbytes is None:
            return (RenamedSource(mapping, names) if rename is not None else mapping), 0
        return RenamedSource(mapping, names, on_read=count), sum(nbytes(k) for k in names.values())
    source = as_source(mapping)
    base, shapes = _base_model_and_shapes(model)
    nodes = resolve_load(base, conversion, {k: source.meta(k) for k in mapping}, shapes=shapes)
    if nodes is None or all(isinstance(n, Leaf) and n.key == k for k, n in nodes.items()):
        return _file_view(model, mapping, None, None, on_read)
    total = sum(nbytes(k) for n in nodes.values() for k in set(n.files())) if nbytes is not None else 0
    count = _counting(nbytes, on_read) if nbytes is not None else None
    return ConvertedSource(mapping, nodes, on_read=count, error=ConversionError), total


def compose(model: nn.Module, mapping: Mapping[str, Any] | None, aliases: Mapping[str, str], *,
            rename: Rename = None, conversion: Any = None,
            on_read: Callable[[int], None] | None = None) -> LoadView:
    """The views of one load of ``mapping`` into ``model``, top to bottom (see the module
    docstring). Builds views only: nothing is read but metadata (a conversion's shapes).

    Args:
        model: the model being loaded (a PEFT model's conversion is resolved on its base model).
        mapping: the caller's full tensors by key, or a checkpoint (``None``/``{}``: this rank
            reads nothing).
        aliases: tied alias fqn -> canonical fqn (:func:`fsdptk._core.names.tensor_groups`).
        rename: checkpoint key -> model key (a callable or a Mapping); wins over ``conversion``.
        conversion: ``"auto"``, a :class:`fsdptk.conversions.Conversion` or ``None`` (keys as they
            are); see :func:`fsdptk.load_safetensors`.
        on_read: called with the bytes of each file key on its first read (a progress bar), when
            the mapping knows its keys' sizes (``nbytes``).

    Raises:
        ConversionError: (a ``ValueError``) checkpoint tensors the conversion cannot combine.
        ValueError: a rename collision; two PEFT model keys standing for one base key.
        TypeError: ``rename`` or ``conversion`` of the wrong kind.

    Examples:
        >>> import torch
        >>> view = compose(torch.nn.Linear(2, 3), {"w": torch.ones(3, 2)}, {}, rename={"w": "weight"})
        >>> sorted(view.source), view.total
        (['weight'], 0)
    """
    file_view, total = _file_view(model, {} if mapping is None else mapping, rename, conversion, on_read)
    viewed = _peft.base_view(model, file_view)
    return LoadView(source=aliased(viewed, aliases), viewed=viewed, total=total)
