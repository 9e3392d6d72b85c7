"""Bit packing of signs: 8 signs per byte, vectorised (no Python loop over elements).

Bit ``i`` of byte ``j`` (least significant first, numpy's ``bitorder="little"``) is the IEEE
sign bit of element ``8j + i``: set for negative numbers (and for -0.0), so ``+0.0`` decodes as
+1 (one bit cannot say 0). Reading the sign bit as "the same-width signed integer is < 0"
works for every float dtype (bfloat16 included) without looking at the value.

* Packing on the CPU uses numpy's SIMD comparison and ``packbits`` into a reused per-thread
  scratch buffer. On other devices it gathers the eight 0/1 bytes of one little-endian int64
  word into its top byte with one multiplication by ``0x0102040810204080`` (each byte's bit
  lands on its own position, so no carry crosses them; higher products wrap away).
* Unpacking indexes a 256-row table (one row of 8 signs per byte value, pre-multiplied by the
  scale), a single gather that writes the output once, on any device.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

_GATHER = 0x0102040810204080
#: the signed integer type of each float width (a float's sign bit is that integer's sign)
SIGNED_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_scratch = threading.local()


def packed_size(n: int) -> int:
    """Bytes that ``n`` packed signs take: ⌈n/8⌉."""
    return (n + 7) // 8


def _workspace(nbytes: int) -> np.ndarray:
    """A reused per-thread bool buffer (a fresh one per call would page-fault every time)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.buf = np.zeros(nbytes, dtype=bool)
    return buf


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``⌈n/8⌉`` uint8 holding the sign bits of ``x`` (flattened), on ``x``'s device."""
    x = x.detach().reshape(-1)
    if not x.is_floating_point():
        raise TypeError(f"pack_signs needs a floating-point tensor, got {x.dtype}")
    n = x.numel()
    nb = packed_size(n)
    ints = x.view(SIGNED_INTS[x.element_size()])
    if x.device.type == "cpu":
        ws = _workspace(nb * 8)
        np.less(ints.numpy(), 0, out=ws[:n])
        ws[n:nb * 8] = False
        return torch.from_numpy(np.packbits(ws[:nb * 8], bitorder="little"))
    return pack_signs_torch(ints, nb)


def pack_signs_torch(ints: torch.Tensor, nb: int) -> torch.Tensor:
    """The device-generic packing of a signed-integer view (see the module docstring)."""
    n = ints.numel()
    neg = torch.zeros(nb * 8, dtype=torch.uint8, device=ints.device)
    torch.lt(ints, 0, out=neg[:n])
    words = neg.view(torch.int64).mul_(_GATHER)
    return words.view(torch.uint8).view(-1, 8)[:, 7].contiguous()


def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 8) table: row b holds the ±1 signs that byte value b encodes."""
    key = (dtype, device)
    if key not in _TABLES:
        b = torch.arange(256, dtype=torch.int64).unsqueeze(1)
        bits = (b >> torch.arange(8, dtype=torch.int64)) & 1
        _TABLES[key] = (1 - 2 * bits).to(dtype=dtype, device=device)
    return _TABLES[key]


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32,
                 scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """The first ``n`` signs (±1, or ±``scale``) that ``packed`` holds in its last dimension: a
    ``(nb,)`` tensor gives ``(n,)``, a ``(K, nb)`` stack gives ``(K, n)``. ``scale`` is a number,
    a one-element tensor, or for a stack a ``(K,)`` tensor (one scale per row)."""
    lead = packed.shape[:-1]
    table = _table(dtype, packed.device)
    per_row = isinstance(scale, torch.Tensor) and scale.numel() > 1
    if scale is not None and not per_row:
        table = table * (scale.to(dtype) if isinstance(scale, torch.Tensor) else scale)
    idx = packed.reshape(-1).to(torch.int32)
    out = table.index_select(0, idx).view(*lead, -1)
    if out.shape[-1] != n:
        out = out[..., :n]
    if per_row:
        out = out * scale.to(dtype).view(*lead, 1)
    return out


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits (0/1 as uint8) of the last dimension of ``packed``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


# ternary values {-1, 0, +1} as base-3 digits, 5 per byte (3^5 = 243 <= 256): 1.6 bits each --------
_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
_TRIT_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def trits_size(n: int) -> int:
    """Bytes that ``n`` ternary values take: ⌈n/5⌉."""
    return (n + 4) // 5


def pack_trits(v: torch.Tensor) -> torch.Tensor:
    """``⌈n/5⌉`` uint8 holding ``v`` (values in {-1, 0, +1}, flattened): byte j is
    ``Σ_i (v[5j+i] + 1)·3^i``, padding digits 1 (value 0)."""
    v = v.detach().reshape(-1)
    n = v.numel()
    d = torch.ones(trits_size(n) * 5, dtype=torch.int32, device=v.device)
    d[:n] = v.to(torch.int32) + 1
    return (d.view(-1, 5) * _POW3.to(v.device)).sum(1).to(torch.uint8)


def unpack_trits(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first ``n`` values in {-1, 0, +1} that :func:`pack_trits` packed into ``packed``."""
    key = (dtype, packed.device)
    if key not in _TRIT_TABLES:
        b = torch.arange(243, dtype=torch.int64).unsqueeze(1)
        digits = (b // torch.tensor([1, 3, 9, 27, 81])) % 3 - 1
        _TRIT_TABLES[key] = torch.cat([digits, torch.zeros(13, 5, dtype=torch.int64)]).to(
            dtype=dtype, device=packed.device)
    return _TRIT_TABLES[key].index_select(0, packed.reshape(-1).to(torch.int32)).reshape(-1)[:n]


# unsigned integers of b bits, packed little-endian into a bit stream -----------------------------
def uints_size(n: int, bits: int) -> int:
    """Bytes that ``n`` unsigned integers of ``bits`` bits take packed: ⌈n·bits/8⌉."""
    return (n * bits + 7) // 8


def pack_uints(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``⌈n·bits/8⌉`` uint8 holding ``v`` (integers in [0, 2^bits), flattened) as one bit
    stream: bit j of value i is bit ``i·bits + j`` of the stream, least significant first."""
    v = v.detach().reshape(-1).to(torch.int64)
    n = v.numel()
    shifts = torch.arange(bits, dtype=torch.int64, device=v.device)
    stream = torch.zeros(uints_size(n, bits) * 8, dtype=torch.uint8, device=v.device)
    stream[:n * bits] = ((v.unsqueeze(1) >> shifts) & 1).reshape(-1)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=v.device)
    return (stream.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_uints(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The first ``n`` integers (int64) of ``bits`` bits each that :func:`pack_uints` packed
    into the last dimension of ``packed``: ``(nb,)`` gives ``(n,)``, ``(K, nb)`` gives ``(K, n)``."""
    lead = packed.shape[:-1]
    stream = unpack_bits(packed, n * bits).to(torch.int64).reshape(*lead, n, bits)
    shifts = torch.arange(bits, dtype=torch.int64, device=packed.device)
    return (stream << shifts).sum(-1)
