"""A base model's checkpoint seen under a wrapped model's keys (PEFT's tuners inject layers, so a
LoRA model's base weights live under ``base_model.model.<...>.base_layer.weight``).

One of the engine's source views, like :class:`~fsdptk._engine.sources.RenamedSource` and the
conversion views of :mod:`fsdptk._engine.sources.convert`: the mapping from model keys to base
keys is computed by the caller (:func:`fsdptk._plans.peft.base_names`, from PEFT's own module
tree); this view only reads through it. Unlike a plain rename it also accepts a full state dict of
the wrapped model itself (a key it holds under the model's name is read as it is), and it forwards
writes (the loaders' ``release_sd``) to the caller's mapping.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fsdptk._engine.sources import as_source, holds_value

__all__ = ["BaseView"]


class BaseView(Mapping[str, Any]):
    """A base model's checkpoint (or full state dict) seen under a PEFT model's keys.

    An engine source (:mod:`fsdptk._engine.sources`) over the caller's mapping: model key ``k`` is
    read from ``k`` itself when the mapping holds it (a full state dict of the PEFT model), else
    from its base key. Keys the mapping holds that stand for no model key are yielded unchanged
    (reported as unexpected). Writes (the loaders' ``release_sd``) go to the underlying key.
    """

    def __init__(self, source: Mapping[str, Any], to_base: dict[str, str], adapters: set[str]) -> None:
        self._src, self._to_base, self.adapters = source, to_base, adapters
        self._from_base = {b: k for k, b in to_base.items()}
        self._inner = as_source(source)

    def _resolve(self, key: str) -> str:
        if key in self._src:
            return key
        base = self._to_base.get(key)
        return base if base is not None and base in self._src else key

    def __getitem__(self, key: str) -> Any:
        return self._src[self._resolve(key)]

    def __setitem__(self, key: str, value: Any) -> None:
        self._src[self._resolve(key)] = value  # type: ignore[index]  # the loaders write (release_sd) only into a MutableMapping

    def __delitem__(self, key: str) -> None:
        del self._src[self._resolve(key)]  # type: ignore[attr-defined]  # as above: a MutableMapping

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._resolve(key) in self._src

    def __iter__(self) -> Iterator[str]:
        for k in self._src:
            model_key = self._from_base.get(k)
            if k in self._to_base or model_key is None or model_key in self._src:
                yield k
            else:
                yield model_key

    def __len__(self) -> int:
        return len(self._src)

    def holds(self, key: str) -> bool:
        """Whether reading ``key`` allocates nothing (see :func:`holds_value`)."""
        return holds_value(self._src, self._resolve(key))

    @property
    def private_reads(self) -> bool:
        """The inner source's ``private_reads`` (the engine's source protocol)."""
        return bool(getattr(self._inner, "private_reads", False))

    def meta(self, key: str) -> Any:
        return self._inner.meta(self._resolve(key))

    def read(self, key: str, box: Any = None) -> torch.Tensor:
        return self._inner.read(self._resolve(key), box)

    def release(self, key: str) -> None:
        self._inner.release(self._resolve(key))
