"""Quantized checkpoint tensors dequantized on read, per box: the leaves of a conversion tree.

Two formats the open-model releases use:

* FP8 block quantization (DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8, Kimi K2): ``<w>`` in
  ``float8_e4m3fn`` with ``<w>_scale_inv``, one scale per ``block_m x block_n`` block of the last two
  dims, the grid rounded up where a dim is not a multiple of the block (DeepSeek-V3's
  ``kv_a_proj_with_mqa``, 576 x 7168 under 128 x 128 blocks, has a 5 x 56 grid). Scales are float32,
  or ``float8_e8m0fnu`` ("ue8m0", a power of two), or uint8 exponents (``2 ** (byte - 127)``).
  :class:`FP8Blocks`.
* MXFP4 (gpt-oss): ``<w>_blocks`` (uint8, two e2m1 values per byte, 16 bytes per group of 32
  values) and ``<w>_scales`` (uint8 e8m0 exponents, one per group), stored transposed against the
  model's fused experts: ``[experts, rows, groups, 16]`` dequantizes to the model's
  ``[experts, groups * 32, rows]``. :class:`MXFP4Blocks`.

The math is the reference one (transformers' ``Fp8Dequantize._dequantize_one`` and
``convert_moe_packed_tensors``): the values to float32, times their block's scale, in float32; the
engine then casts to the model's dtype. A box reads only the quantized bytes it covers and the scale
blocks it intersects. The inverse (``split``, a save's) quantizes the full tensor back into the same
layout (:mod:`fsdptk._engine.sources.quantize`: vLLM's ``per_block_cast_to_fp8`` for FP8, gpt-oss's
MXFP4): the trees of a quantized save have these leaves. A load of a quantized release saves
unquantized, through plain leaves (its save layout has no scales).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fsdptk._engine.layouts import Box
from fsdptk._engine.sources.convert import ConversionProblem, Node, box_indices
from fsdptk._engine.sources.quantize import NonFiniteError, fp8_block_quantize, mxfp4_quantize

__all__ = ["FP8Blocks", "MXFP4Blocks", "FP4_VALUES", "scale_grid", "block_size_problem"]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _refused(name: str, e: NonFiniteError) -> ValueError:
    """The error of a save (or weight source) asked to quantize ``name`` holding inf or NaN."""
    return ValueError(f"cannot quantize {name!r}: {e}. Find where the weight became inf or NaN, or leave "
                      "it unquantized (quantize_if)")


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of ``shape`` under ``block`` (rounded up).

    Example:
        >>> scale_grid((576, 7168), (128, 128))
        (5, 56)
    """
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def block_size_problem(block: Any) -> str | None:
    """Why ``block`` is not a block size (two positive ints: rows, columns), or ``None``.

    Example:
        >>> block_size_problem([128, 128]) is None, block_size_problem([0, 32])
        (True, 'its entries must be positive ints, got [0, 32]')
    """
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        return f"it must be a list of two ints (block rows, block columns), got {block!r}"
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block):
        return f"its entries must be positive ints, got {list(block)!r}"
    return None


_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                 *(getattr(torch, n) for n in ("float8_e8m0fnu",) if hasattr(torch, n)))


def _scales_f32(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.uint8:
        return (s.to(torch.float32) - 127.0).exp2()
    return s.to(torch.float32)


def _scales_as(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 scales stored as ``dtype`` (the inverse of :func:`_scales_f32`; uint8: the exponent
    byte of a power of two)."""
    if dtype == torch.uint8:
        return (torch.log2(s).round() + 127.0).clamp(0, 255).to(torch.uint8)
    return s.to(dtype)


@dataclass(eq=False)
class FP8Blocks(Node):
    """An FP8 weight dequantized with its per-block scales (``weight_scale_inv``).

    Args:
        weight: the quantized weight's node (a leaf in a float8 dtype).
        scale: the scales' node (``scale_grid(weight.shape, block)``).
        block: ``(block_m, block_n)`` over the last two dims.
        ue8m0: a save rounds the scales up to powers of two (``scale_fmt: "ue8m0"``); a read
            takes the scales as they are stored either way.
    """

    weight: Node
    scale: Node
    block: tuple[int, int]
    ue8m0: bool = False

    def __post_init__(self) -> None:
        wkey, skey = self.weight.files()[0], self.scale.files()[0]
        wshape, sshape = list(self.weight.shape), list(self.scale.shape)
        problem = block_size_problem(self.block)
        if problem is not None:
            raise ConversionProblem(f"{wkey!r} (shape {wshape}) has block scales {skey!r}, but the block "
                                    f"size is not one: {problem}")
        if len(wshape) < 2:
            raise ConversionProblem(
                f"{wkey!r} has shape {wshape} ({len(wshape)}-D) with block scales {skey!r} of shape {sshape}: "
                "block scales cover the last two dims of a weight of at least 2 dims")
        want = scale_grid(self.weight.shape, self.block)
        if tuple(sshape) != want:
            raise ConversionProblem(
                f"{skey!r} has shape {sshape}, but weight {wkey!r} of shape {wshape} in blocks of "
                f"{list(self.block)} needs a scale grid of {list(want)}")
        if self.scale.dtype not in _SCALE_DTYPES:
            raise ConversionProblem(
                f"{skey!r} (the scales of {wkey!r}) is {self.scale.dtype}; FP8 block scales are float32, "
                "bfloat16, float16, float8_e8m0fnu or uint8 exponents")
        self.shape, self.dtype = tuple(self.weight.shape), torch.float32

    def _scale_box(self, box: Box) -> tuple[Box, list[list[int]]]:
        """The scale rows/cols a box needs, and each box index's position among them."""
        lead, out = box[:-2], []
        sbox: list[Any] = list(lead)
        for b, n in zip(box[-2:], self.block):
            ix = box_indices(b)
            lo = min(ix) // n if ix else 0
            hi = max(ix) // n + 1 if ix else 0
            sbox.append(slice(lo, hi))
            out.append([i // n - lo for i in ix])
        return tuple(sbox), out

    def _aligned(self, box: Box) -> bool:
        """Whether the box's last two dims are whole blocks (each scale covers a full tile)."""
        return all(isinstance(b, slice) and b.start % n == 0 and (b.stop - b.start) % n == 0
                   for b, n in zip(box[-2:], self.block))

    def read(self, source: Any, box: Box) -> torch.Tensor:
        q = self.weight.read(source, box).to(torch.float32, memory_format=torch.contiguous_format,
                                             copy=True)  # fresh memory: scaled in place
        sbox, (rows, cols) = self._scale_box(box)
        s = _scales_f32(self.scale.read(source, sbox))
        if self._aligned(box):  # tiles broadcast against their scales: no expanded scale tensor
            (bm, bn), (r, c) = self.block, q.shape[-2:]
            lead = q.shape[:-2]
            q.view(*lead, r // bm, bm, c // bn, bn).mul_(s.reshape(*lead, r // bm, 1, c // bn, 1))
            return q
        s = s.index_select(-2, torch.tensor(rows, dtype=torch.long)).index_select(
            -1, torch.tensor(cols, dtype=torch.long))
        return q.mul_(s)

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        yield from self.weight.leaves(box)
        yield from self.scale.leaves(self._scale_box(box)[0])

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        # the inverse of read: the full tensor quantized, the weight's and the scales' tensors
        try:
            q, s = fp8_block_quantize(full, self.block, ue8m0=self.ue8m0)
        except NonFiniteError as e:
            raise _refused(self.weight.files()[0], e) from None
        yield from self.weight.split(q.to(self.weight.dtype))
        yield from self.scale.split(_scales_as(s, self.scale.dtype))


@dataclass(eq=False)
class MXFP4Blocks(Node):
    """MXFP4 ``<w>_blocks`` / ``<w>_scales`` dequantized into the model's (transposed) tensor.

    ``blocks`` is ``[*lead, rows, groups, 16]`` (uint8, two e2m1 values per byte, low nibble
    first), ``scales`` ``[*lead, rows, groups]`` (uint8 e8m0 exponents); the model's tensor is
    ``[*lead, groups * 32, rows]``. ``key`` is the weight's name (``<w>``, the key it is read under).
    """

    blocks: Node
    scales: Node
    key: str

    def __post_init__(self) -> None:
        b, s = tuple(self.blocks.shape), tuple(self.scales.shape)
        if len(b) < 3 or b[-1] != 16 or b[:-1] != s:
            raise ConversionProblem(
                f"{self.blocks.files()[0]!r} (shape {list(b)}) and {self.scales.files()[0]!r} (shape "
                f"{list(s)}) are not an MXFP4 pair: blocks [..., rows, groups, 16] with scales [..., rows, groups]")
        for node, what in ((self.blocks, "blocks (two e2m1 values a byte)"), (self.scales, "scales (e8m0 exponents)")):
            if node.dtype != torch.uint8:
                raise ConversionProblem(f"{node.files()[0]!r} is {node.dtype}: MXFP4 {what} are uint8")
        self.shape = (*b[:-3], b[-2] * 32, b[-3])
        self.dtype = torch.float32

    def _source_boxes(self, box: Box) -> tuple[Box, Box, list[int]]:
        lead, cols, rows = box[:-2], box[-2], box[-1]  # model [.., groups*32, rows]
        ix = box_indices(cols)
        g0 = min(ix) // 32 if ix else 0
        g1 = max(ix) // 32 + 1 if ix else 0
        sbox = (*lead, rows, slice(g0, g1))
        return (*sbox, slice(0, 16)), sbox, [i - 32 * g0 for i in ix]

    def read(self, source: Any, box: Box) -> torch.Tensor:
        bbox, sbox, pick = self._source_boxes(box)
        blocks = self.blocks.read(source, bbox).to(torch.uint8)
        exps = self.scales.read(source, sbox).to(torch.int32) - 127
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
        vals = vals.reshape(*blocks.shape[:-1], 32)  # [.., rows, g, 32]
        vals = torch.ldexp(vals, exps.unsqueeze(-1).to(torch.float32))
        vals = vals.reshape(*vals.shape[:-2], -1)  # [.., rows, g*32 (from g0)]
        vals = vals.index_select(-1, torch.tensor(pick, dtype=torch.long))
        return vals.transpose(-1, -2)

    def leaves(self, box: Box) -> Iterator[tuple[str, Box]]:
        bbox, sbox, _ = self._source_boxes(box)
        yield from self.blocks.leaves(bbox)
        yield from self.scales.leaves(sbox)

    def split(self, full: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        # the inverse of read: the full tensor quantized into gpt-oss's blocks and scales
        try:
            blocks, scales = mxfp4_quantize(full)
        except NonFiniteError as e:
            raise _refused(self.key, e) from None
        yield from self.blocks.split(blocks)
        yield from self.scales.split(scales)
