"""DeMo's compression: an orthonormal DCT over fixed-size chunks of a tensor, and the top-k
coefficients of every chunk (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

:class:`ChunkedDCT` maps a parameter-shaped tensor to its DCT-II coefficients, one row per chunk
(a matrix is cut into n1×n2 blocks, each transformed in 2-D; anything else into chunks of n1
elements), and back with the inverse, the DCT-III. The chunk sides are the largest divisors of
the tensor's sides not above the target (the reference implementation's rule), so every chunk is
whole; a tensor of more than two dimensions is treated as the matrix ``(shape[0], rest)``.

:class:`ChunkTopK` is the codec of those rows: the k largest magnitudes of every row, sent as
values and their indices inside the row (int16 while a row has at most 32767 elements). Its
:meth:`ChunkTopK.bounds` cuts a bucket between rows, so the two-phase exchange gives every owner
whole chunks to re-select. :class:`QuantizedChunkTopK` sends the same selection with its values
in 1 or 2 bits and, optionally, its indices bit-packed (DisTrO's sign values; SparseLoCo's 2-bit
values and ⌈log2 row⌉-bit indices). :class:`Chunks` is the chunking alone (SparseLoCo's tiles).
"""
from __future__ import annotations

import math

import torch

from ..comm.collectives import chunk_bounds
from .base import Codec
from .bits import pack_uints, uints_size, unpack_uints
from .quantize import QUANT_BLOCK, stat_dequantize, stat_quantize


def dct_matrix(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n×n): ``(D x)_f = a_f Σ_i x_i cos(π (2i+1) f / 2n)``,
    ``a_0 = √(1/n)``, ``a_f = √(2/n)``; its inverse, the DCT-III, is ``Dᵀ``. Built in float64."""
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


def chunk_side(size: int, target: int) -> int:
    """The largest divisor of ``size`` that is at most ``target`` (``size`` itself when it is
    at most ``target``)."""
    if size <= target:
        return size
    return max(d for d in range(1, target + 1) if size % d == 0)


class Chunks:
    """Tensors of one shape cut into fixed-size chunks, one row per chunk, and put back.

    A matrix is cut into n1×n2 tiles (its rows and columns each in runs of the largest divisor
    not above the target: 64×64 tiles for a 64 target); anything else into runs of n1 elements.
    Each tile becomes one row, in row-major order of the tiles and of the elements inside a tile.

    Args:
        shape: the tensor's shape.
        target: the chunk side s (DeMo's ``compression_chunk``; SparseLoCo's tiles, 64).
    Attributes:
        sides: ``(n1, n2)`` for a matrix, ``(n1,)`` otherwise; ``row`` = n1·n2 (or n1), the
        elements of one chunk; ``rows``, the number of chunks.
    """

    def __init__(self, shape: torch.Size, target: int):
        self.shape = torch.Size(shape)
        numel = self.shape.numel()
        if len(self.shape) >= 2:
            self.matrix = (self.shape[0], numel // self.shape[0])
            self.sides = (chunk_side(self.matrix[0], target), chunk_side(self.matrix[1], target))
        else:
            self.matrix = None
            self.sides = (chunk_side(max(numel, 1), target),)
        self.row = math.prod(self.sides)
        self.rows = numel // self.row

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The chunks of ``x`` (of ``shape``), as ``(rows, row)``."""
        if self.matrix is None:
            return x.reshape(self.rows, self.row)
        (r, c), (n1, n2) = self.matrix, self.sides
        return x.reshape(r // n1, n1, c // n2, n2).transpose(1, 2).reshape(self.rows, self.row)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """The tensor (of ``shape``) whose chunks are ``rows`` (``rows × row``)."""
        if self.matrix is None:
            return rows.reshape(self.shape)
        (r, c), (n1, n2) = self.matrix, self.sides
        return rows.reshape(r // n1, c // n2, n1, n2).transpose(1, 2).reshape(self.shape)


class ChunkedDCT(Chunks):
    """The chunked DCT-II of tensors of one shape, and its inverse: :class:`Chunks` whose every
    chunk is transformed (a matrix's tiles in 2-D).

    Args:
        shape: the tensor's shape.
        target: the chunk side s (DeMo's ``compression_chunk``, 64 in the paper).
    """

    def __init__(self, shape: torch.Size, target: int):
        super().__init__(shape, target)
        self._bases: dict = {}

    def _basis(self, n: int, like: torch.Tensor) -> torch.Tensor:
        key = (n, like.dtype, like.device)
        if key not in self._bases:
            self._bases[key] = dct_matrix(n, like.dtype, like.device)
        return self._bases[key]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The coefficients of ``x`` (of ``shape``), as ``(rows, row)``."""
        if self.matrix is None:
            d = self._basis(self.sides[0], x)
            return x.reshape(self.rows, self.row) @ d.T
        (r, c), (n1, n2) = self.matrix, self.sides
        blocks = x.reshape(r // n1, n1, c // n2, n2)
        d1, d2 = self._basis(n1, x), self._basis(n2, x)
        return torch.einsum("yhxw,ah,bw->yxab", blocks, d1, d2).reshape(self.rows, self.row)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """The tensor (of ``shape``) whose coefficients are ``coeffs`` (``rows × row``)."""
        if self.matrix is None:
            d = self._basis(self.sides[0], coeffs)
            return (coeffs.reshape(self.rows, self.row) @ d).reshape(self.shape)
        (r, c), (n1, n2) = self.matrix, self.sides
        blocks = coeffs.reshape(r // n1, c // n2, n1, n2)
        d1, d2 = self._basis(n1, coeffs), self._basis(n2, coeffs)
        return torch.einsum("yxab,ah,bw->yhxw", blocks, d1, d2).reshape(self.shape)


class ChunkTopK(Codec):
    """Top-k per row of a flat bucket of ``row``-element rows (DeMo's ``ExtractFastComponents``
    after the transform).

    Update, per bucket x of n = rows·row elements:
      1. per row, the indices I of the ``k = min(topk, row)`` largest ``|x_i|`` (``torch.topk``);
      2. send ``x_I`` (x's dtype) and I (int16 while row ≤ 32767, else int32);
      3. the mean of K ranks' payloads, row by row: ``average = "all"``:
         ``(1/K) Σ_k scatter_add(I_k, x_{I_k})``; ``"senders"`` (the DeMo reference code's
         ``scatter_reduce(reduce="mean", include_self=False)``): each coefficient's sum over the
         ranks that sent it divided by their number, ``n_i = |{k : i ∈ I_k}|`` (0 where none did).
    Bytes of a payload: ``rows · k · (value bytes + index bytes)``.

    Args:
        row: elements of one chunk.
        topk: coefficients kept per chunk.
        average: "all" or "senders" (step 3).
    """

    name, summable = "demo", False
    AVERAGES = ("all", "senders")

    def __init__(self, row: int, topk: int, average: str = "all"):
        if row < 1 or topk < 1:
            raise ValueError(f"row and topk must be >= 1, got {row}, {topk}")
        if average not in self.AVERAGES:
            raise ValueError(f"average must be one of {', '.join(self.AVERAGES)}, got {average!r}")
        self.row, self.k, self.average = int(row), min(int(topk), int(row)), average
        self.index_dtype = torch.int16 if row <= torch.iinfo(torch.int16).max else torch.int32

    def bounds(self, n: int, K: int) -> list[int]:
        """Owner chunks of whole rows (the two-phase exchange's cut)."""
        return [self.row * b for b in chunk_bounds(n // self.row, K)]

    def payload_layout(self, n, dtype, nseg=1):
        m = n // self.row * self.k
        return [(dtype, (m,)), (self.index_dtype, (m,))]

    def encode(self, x, key, segments, rank=None):
        rows = x.reshape(-1, self.row)
        idx = rows.abs().topk(self.k, dim=1, sorted=False).indices
        return [rows.gather(1, idx).reshape(-1), idx.to(self.index_dtype).reshape(-1)], x.numel()

    def decompress(self, payload, ctx):
        values, idx = payload
        out = torch.zeros(ctx // self.row, self.row, dtype=values.dtype, device=values.device)
        return out.scatter_(1, idx.long().view(-1, self.k), values.view(-1, self.k)).view(-1)

    def decompress_mean(self, gathered, ctx, K):
        values, idx = gathered                  # (K, rows·k) each
        rows = ctx // self.row
        v = values.reshape(K, rows, self.k).permute(1, 0, 2).reshape(rows, K * self.k)
        i = idx.reshape(K, rows, self.k).permute(1, 0, 2).reshape(rows, K * self.k).long()
        out = torch.zeros(rows, self.row, dtype=values.dtype, device=values.device)
        out.scatter_add_(1, i, v)
        if self.average == "all":
            return out.div_(K).view(-1)
        senders = torch.zeros_like(out).scatter_add_(1, i, torch.ones_like(v))
        return out.div_(senders.clamp_(min=1)).view(-1)

    def subtract_decoded_(self, p, payload, ctx):
        values, idx = payload                   # only the k sent entries of each row change
        p.view(-1, self.row).scatter_add_(1, idx.long().view(-1, self.k),
                                          values.view(-1, self.k).neg().to(p.dtype))
        return p


class QuantizedChunkTopK(ChunkTopK):
    """:class:`ChunkTopK`'s selection sent in fewer bits: the k values of every row in
    ``value_bits`` bits, their indices packed in ``⌈log2 row⌉`` bits each (``packed_indices``)
    or as ChunkTopK's int16/int32.

    Values, per bucket of n = rows·row elements, m = rows·k of them selected:

    * ``value_bits = 2`` (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706): the statistical
      quantiser of the authors' code (:func:`~lowcomm.compress.quantize.stat_quantize`: per
      block of ``block`` values a mean and 4 bins of width 6σ/4, each decoded as the mean of its
      values); error feedback keeps ``x − D(C(x))``, the quantisation error of what was sent
      included;
    * ``value_bits = 1`` (DisTrO, Psyche's DeMo with ``quantize_1bit``): one bit per value,
      set where it is positive, decoded as ±1 (no scale: the method steps with a sign); the
      selected values leave the error-feedback memory whole, as in Psyche's code (the momentum
      loses what was selected, not its ±1 image).

    Bytes of a payload: ``⌈m·value_bits/8⌉`` (+ ``4·5·⌈m/block⌉`` for the 2-bit tables) +
    ``⌈m·⌈log2 row⌉/8⌉`` packed indices (or ``m·2``, int16). The mean of K payloads is
    ``(1/K) Σ_k scatter_add(I_k, D(v_k))``, row by row (or over the senders, as ChunkTopK's).

    Args:
        row, topk: as :class:`ChunkTopK`.
        value_bits: 1 or 2.
        packed_indices: indices in ``⌈log2 row⌉`` bits (True) or ChunkTopK's integers.
        block: values sharing one quantisation table (2 bits).
        average: as :class:`ChunkTopK`'s.
    """

    def __init__(self, row: int, topk: int, value_bits: int = 2, packed_indices: bool = True,
                 block: int = QUANT_BLOCK, average: str = "all"):
        super().__init__(row, topk, average)
        if value_bits not in (1, 2):
            raise ValueError(f"value_bits must be 1 or 2, got {value_bits}")
        self.value_bits, self.packed_indices, self.block = int(value_bits), bool(packed_indices), int(block)
        self.index_bits = max(1, math.ceil(math.log2(self.row))) if packed_indices else \
            8 * torch.empty(0, dtype=self.index_dtype).element_size()
        self.name = f"chunk-topk-{value_bits}bit"

    def payload_layout(self, n, dtype, nseg=1):
        m = n // self.row * self.k
        out = [(torch.uint8, (uints_size(m, self.value_bits),))]
        if self.value_bits == 2:
            out.append((torch.float32, (-(-m // min(self.block, max(m, 1))), 5)))
        out.append((torch.uint8, (uints_size(m, self.index_bits),)) if self.packed_indices
                   else (self.index_dtype, (m,)))
        return out

    def encode(self, x, key, segments, rank=None):
        (values, idx), n = super().encode(x, key, segments, rank)
        if self.value_bits == 1:
            payload, ctx = [pack_uints(values > 0, 1)], (n, values)
        else:
            codes, table = stat_quantize(values, 2, self.block)
            payload, ctx = [pack_uints(codes, 2), table], (n, None)
        payload.append(pack_uints(idx.long(), self.index_bits) if self.packed_indices else idx)
        return payload, ctx

    def _unpacked(self, gathered, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of K stacked payloads, ``(K, m)`` each."""
        m = n // self.row * self.k
        codes = unpack_uints(gathered[0], m, self.value_bits)
        if self.value_bits == 1:
            values = codes.to(dtype).mul_(2).sub_(1)
        else:
            values = stat_dequantize(codes, gathered[1], m, self.block, dtype)
        idx = gathered[-1]
        idx = unpack_uints(idx, m, self.index_bits) if self.packed_indices else idx.long()
        return values, idx

    def decompress(self, payload, ctx):
        return self.decompress_mean([t.unsqueeze(0) for t in payload], ctx, 1)

    def decompress_mean(self, gathered, ctx, K):
        n, selected = ctx
        # 1 bit: ±1 in the values' own dtype, so a mean over 3 senders rounds as theirs would
        dtype = torch.float32 if selected is None else selected.dtype
        values, idx = self._unpacked(gathered, n, dtype)
        return super().decompress_mean([values, idx], n, K)

    def subtract_decoded_(self, p, payload, ctx):
        n, selected = ctx
        values, idx = self._unpacked([t.unsqueeze(0) for t in payload], n, p.dtype)
        return super().subtract_decoded_(p, [values[0] if selected is None else selected, idx[0]], n)
