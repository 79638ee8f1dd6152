"""Quantizers: full tensors into the releases' FP8 block and MXFP4 layouts (the save direction).

The inverse of the dequantizing leaves of :mod:`fsdptk._engine.sources.quant`: ``FP8Blocks.split``
and ``MXFP4Blocks.split`` call these on the full tensor a writer holds, one tensor at a time.

* :func:`fp8_block_quantize`: e4m3 per ``(b0, b1)`` block of the last two dims with float32
  ``weight_scale_inv`` scales, the arithmetic of vLLM's ``per_block_cast_to_fp8``
  (``vllm.utils.deep_gemm``) step for step, so the bytes and scales are equal bit for bit: the
  tensor zero-padded to whole blocks, ``amax`` per block in float32 clamped at ``1e-4``, the scale
  ``amax / 448``, with ``ue8m0`` rounded up to a power of two (``2 ** ceil(log2(s))``, DeepSeek-V3.1's
  scales, which it stores as float32), then ``x * (1 / s)`` cast to ``float8_e4m3fn``. Leading
  dims (fused experts) are quantized per slice, as vLLM does for each 2-D weight.
* :func:`mxfp4_quantize`: gpt-oss's MXFP4 (``_blocks`` / ``_scales``): groups of 32 along the
  model tensor's dim -2, stored transposed (``[*lead, cols, rows]`` -> blocks ``[*lead, rows,
  cols / 32, 16]``, scales ``[*lead, rows, cols / 32]``); the arithmetic of triton_kernels'
  ``downcast_to_mxfp_torch`` (the reference of the kernels transformers uses for gpt-oss): the scale
  ``amax / 6`` rounded up to a power of two (its e8m0 byte is the float32 exponent), values times
  the inverse scale rounded to e2m1 with ties away from zero (:func:`e2m1_codes`), two per byte,
  the even-indexed value in the low nibble.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "AMAX_FLOOR", "fp8_block_quantize", "mxfp4_quantize", "e2m1_codes", "MXFP4_GROUP",
           "NonFiniteError"]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # per_block_cast_to_fp8's clamp: an all-zero block gets the scale 1e-4 / 448
MXFP4_GROUP = 32

# e2m1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6: a magnitude gets the code of the number of these
# thresholds it reaches (the midpoints, each rounding up), saturating at 6
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class NonFiniteError(ValueError):
    """The tensor to quantize holds inf or NaN: its block's scale would be inf or NaN (FP8: a
    block of NaN with scale inf; MXFP4: scale byte 255, or codes from NaN), a release that loads
    but computes garbage. ``count``: how many of its values are not finite."""

    def __init__(self, x: torch.Tensor, method: str) -> None:
        self.count = int((~torch.isfinite(x)).sum())
        super().__init__(f"{self.count} of its {x.numel()} values (shape {list(x.shape)}) are not finite "
                         f"(inf or NaN), and {method} cannot represent them: the block's scale would be "
                         "inf or NaN")


def _check_finite(x: torch.Tensor, amax: torch.Tensor, method: str) -> None:
    """Raise :class:`NonFiniteError` where a block's amax (which inf and NaN reach) is not finite."""
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteError(x, method)


def _ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, torch.ceil(torch.log2(s.abs())))


def fp8_block_quantize(x: torch.Tensor, block: tuple[int, int] = (128, 128), *, ue8m0: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (at least 2-D, floating) as ``float8_e4m3fn`` values and float32 block scales.

    Args:
        x: the weight; blocks tile its last two dims, a ragged edge block padded with zeros.
        block: ``(rows, columns)`` of a block.
        ue8m0: scales rounded up to a power of two (``scale_fmt: "ue8m0"``).

    Returns:
        ``(q, scale)``: ``q`` of ``x``'s shape, ``scale`` of shape ``(*lead, ceil(rows / b0),
        ceil(cols / b1))``, with ``q.float() * scale`` (expanded per block) approximating ``x``.

    Raises:
        ValueError: ``x`` has fewer than 2 dims or is not floating.
        NonFiniteError: ``x`` holds inf or NaN (a ValueError naming how many values).

    Example:
        >>> q, s = fp8_block_quantize(torch.full((3, 5), 2.0), (2, 4))
        >>> q.dtype, tuple(s.shape), (s * 448).tolist()
        (torch.float8_e4m3fn, (2, 2), [[2.0, 2.0], [2.0, 2.0]])
        >>> q.float().unique().tolist()
        [448.0]
    """
    if x.dim() < 2 or not x.dtype.is_floating_point:
        raise ValueError(f"FP8 block quantization needs a floating tensor of at least 2 dims, got shape "
                         f"{list(x.shape)} ({x.dtype})")
    bm, bn = block
    *lead, m, n = x.shape
    gm, gn = -(-m // bm), -(-n // bn)
    padded = x
    if (gm * bm, gn * bn) != (m, n):
        padded = torch.zeros(*lead, gm * bm, gn * bn, dtype=x.dtype, device=x.device)
        padded[..., :m, :n] = x
    tiles = padded.reshape(*lead, gm, bm, gn, bn)
    amax = tiles.abs().float().amax(dim=(-3, -1), keepdim=True)
    _check_finite(x, amax, "FP8")
    amax = amax.clamp(AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = _ceil_pow2(scale)
    q = (tiles * (1.0 / scale)).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, gm * bm, gn * bn)[..., :m, :n].contiguous()
    return q, scale.reshape(*lead, gm, gn)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 values (already divided by their scale) as e2m1 codes (uint8, 0..15; bit 3 the sign).

    Magnitudes round to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 with ties away from zero and
    saturate at 6; the sign is the float's sign bit (``-0.0`` is code 8).

    Example:
        >>> e2m1_codes(torch.tensor([0.2, 0.25, -1.3, 2.5, 7.0, -0.0])).tolist()
        [0, 1, 11, 5, 7, 8]
    """
    bounds = torch.tensor(_E2M1_THRESHOLDS, dtype=torch.float32, device=v.device)
    codes = torch.bucketize(v.abs(), bounds, right=True).to(torch.uint8)
    return codes | (torch.signbit(v).to(torch.uint8) << 3)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's tensor ``[*lead, cols, rows]`` as gpt-oss's MXFP4 ``(blocks, scales)``.

    Args:
        w: floating, at least 2-D, ``cols`` (dim -2) a multiple of 32.

    Returns:
        ``blocks`` (uint8 ``[*lead, rows, cols / 32, 16]``, two e2m1 codes a byte, the even-indexed
        value in the low nibble) and ``scales`` (uint8 e8m0 exponents ``[*lead, rows, cols / 32]``,
        the scale ``2 ** (byte - 127)``).

    Raises:
        ValueError: fewer than 2 dims, not floating, or dim -2 not a multiple of 32.
        NonFiniteError: ``w`` holds inf or NaN (a ValueError naming how many values).

    Example:
        >>> blocks, scales = mxfp4_quantize(torch.full((64, 3), 3.0))  # 3 = 6 (code 7) * 2 ** (126 - 127)
        >>> tuple(blocks.shape), tuple(scales.shape), scales[0, 0].item(), hex(blocks[0, 0, 0].item())
        ((3, 2, 16), (3, 2), 126, '0x77')
    """
    if w.dim() < 2 or not w.dtype.is_floating_point or w.shape[-2] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 quantizes a floating tensor of at least 2 dims whose dim -2 is a multiple "
                         f"of {MXFP4_GROUP}, got shape {list(w.shape)} ({w.dtype})")
    t = w.transpose(-1, -2).to(torch.float32).contiguous()
    *lead, rows, cols = t.shape
    groups = t.reshape(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    _check_finite(w, amax, "MXFP4")
    bits = (amax / 6.0).view(torch.int32)
    rounded = (bits + 0x007FFFFF) & 0x7F800000  # the scale rounded up to a power of two
    scale = rounded.view(torch.float32)
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    codes = e2m1_codes(groups * inverse)  # [*lead, rows, g, 32]
    pairs = codes.reshape(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (rounded >> 23).to(torch.uint8).squeeze(-1)
    return blocks.contiguous(), scales.contiguous()
