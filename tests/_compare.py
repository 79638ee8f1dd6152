"""Compare state dicts key by key, so a failing round trip names the tensor that differs (a test
returns the list of differences, [] when there is none, instead of a bare boolean)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def tensor_diffs(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *,
                 order: bool = False, dtype: bool = True,
                 convert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[str]:
    """One line per key of ``got`` and ``want`` that differs: missing, unexpected, dtype, shape,
    DTensor placements or values (with the largest difference); with ``order``, also a key order
    that differs. ``convert`` maps both tensors before the value comparison (e.g. dequantise)."""
    out = [f"{k}: missing" for k in want if k not in got]
    out += [f"{k}: unexpected" for k in got if k not in want]
    if order and not out and list(got) != list(want):
        out.append(f"key order {list(got)} != {list(want)}")
    for k, w in want.items():
        if k not in got:
            continue
        g = got[k]
        gp, wp = getattr(g, "placements", None), getattr(w, "placements", None)
        if gp is not None or wp is not None:
            if tuple(gp or ()) != tuple(wp or ()):
                out.append(f"{k}: placements {gp} != {wp}")
                continue
            g, w = g.to_local(), w.to_local()  # type: ignore[attr-defined]
        if dtype and g.dtype != w.dtype:
            out.append(f"{k}: dtype {g.dtype} != {w.dtype}")
        elif g.shape != w.shape:
            out.append(f"{k}: shape {list(g.shape)} != {list(w.shape)}")
        else:
            a, b = (convert(g), convert(w)) if convert is not None else (g, w)
            if not torch.equal(a, b):
                worst = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                out.append(f"{k}: values differ (max |difference| {worst:g})")
    return out
