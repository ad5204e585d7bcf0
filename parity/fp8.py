"""FP8 (e4m3fn) cache entries with a per-token power-of-two scale, the same bits on any device.

A cached vector `x` (one token's MLA latent + RoPE key, or its index key) is stored as one byte
per element plus one fp32 scale per token: `x ≈ value(code) · 2^t`. Everything is built so
that the only rounding is the e4m3 rounding itself, and that one is our own code:

- The scale is the smallest power of two `2^t` with `amax(|x|) ≤ 448 · 2^t` (448 is e4m3fn's
  largest finite value). `amax` is exact in any order (max is), `t` comes from `frexp` (exact)
  and integer compares, and `2^t` and `2^-t` are made from their exponent bits. Dividing by the
  scale is then a multiplication by a power of two, which is exact.
- The encoding (`encode_e4m3`) rounds to nearest, ties to even, with `frexp`, products by
  powers of two and `torch.round` (IEEE round-half-even) only: no vendor fp8 conversion (whose
  saturation and NaN rules differ between libraries), so a CPU and a GPU give the same codes.
- Decoding is a lookup in a 256-entry table of exact fp32 values, built on the CPU from integers,
  times the scale (exact again). A decoded value has at most 4 significant bits, so it is
  exact in bf16 too: casting to the model dtype does not round.

The trainer applies `fake_quantize` at the points where the rollout writes and reads its cache,
so both sides attend over the same values, bit for bit.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
NAN_CODE = 0x7F
SCALE_BYTES = 4  # one fp32 scale per token and cache entry


def _e4m3_values() -> torch.Tensor:
    """value(code) for the 256 codes (fp32, exact; the two NaN codes read as NaN)."""
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values.append(float("nan"))
        elif exponent == 0:
            values.append(sign * mantissa * 2.0**-9)
        else:
            values.append(sign * (8 + mantissa) * 2.0 ** (exponent - 10))
    return torch.tensor(values, dtype=torch.float32)


_VALUES = _e4m3_values()


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent (int tensor, clamped to fp32's normal range [-126, 127]) as fp32, from its bits."""
    bits = (exponent.to(torch.int32).clamp(-126, 127) + 127) << 23
    return bits.view(torch.float32)


def token_scale_exponent(x: torch.Tensor) -> torch.Tensor:
    """Per row of `x` (last dim): the smallest t with amax|x| <= 448 * 2^t (int32, [..., 1])."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    mantissa, exponent = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1) (0 for amax = 0)
    # 448 = 0.875 * 2^9: amax <= 0.875 * 2^(9 + t)  <=>  t >= e - 9 + (m > 0.875)
    return exponent - 9 + (mantissa > 0.875).to(exponent.dtype)


def encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (uint8) of fp32 `y` with |y| <= 448, rounded to nearest, ties to even; NaN
    gives NAN_CODE. Values above 448 are a caller's error (the scale keeps them in range)."""
    y = y.float()
    magnitude = y.abs()
    subnormal = torch.round(magnitude * 512.0)  # |y| < 2^-6: codes 0..8, exact steps of 2^-9
    mantissa, exponent = torch.frexp(magnitude)  # |y| = m * 2^e, m in [0.5, 1)
    # A normal |y| in [2^(e-1), 2^e): code = (e + 5) * 8 + round(16 m); a round up to 16 carries
    # into the exponent with the same formula.
    normal = (exponent + 5).float() * 8.0 + torch.round(mantissa * 16.0)
    code = torch.where(magnitude < 2.0**-6, subnormal, normal).to(torch.int32)
    code = code | (torch.signbit(y).to(torch.int32) << 7)
    code = torch.where(torch.isnan(y), torch.full_like(code, NAN_CODE), code)
    return code.to(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 values of e4m3fn codes (uint8)."""
    return _VALUES.to(codes.device)[codes.long()]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 like `x`, scale fp32 [..., 1]) for each row of `x` (its last dim)."""
    t = token_scale_exponent(x)
    codes = encode_e4m3(x.float() * power_of_two(-t))
    return codes, power_of_two(t)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize` stored, in `dtype` (exact in fp32 and bf16)."""
    return (decode_e4m3(codes) * scale).to(dtype)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize(x)
        return dequantize(codes, scale, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: what a reader of an FP8 cache sees. The gradient
    passes straight through (`x + (fq - x).detach()` would not give fq's bits forward)."""
    return _FakeQuantize.apply(x)


def entry_bytes(width: int, dtype: str) -> int:
    """Cache bytes per token for one entry of `width` values: FP8 adds its scale."""
    return width + SCALE_BYTES if dtype == "fp8" else width * {"bf16": 2, "fp32": 4}[dtype]


def fake_quantize_groups(entry: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """fake_quantize of each consecutive group of `widths` values along the last dim (a cache
    entry whose parts carry a scale each), in entry's dtype."""
    return torch.cat([fake_quantize(part) for part in entry.split(widths, dim=-1)], dim=-1)


def packed_bytes(widths: tuple[int, ...]) -> int:
    """Bytes of one packed entry: per group its codes and its fp32 scale."""
    return sum(widths) + SCALE_BYTES * len(widths)


def pack(entry: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """uint8 [..., packed_bytes(widths)]: per group of `widths` values its codes, then its
    scale's four bytes. For an entry fake_quantize_groups made, unpack returns it exactly."""
    parts = []
    for part in entry.split(widths, dim=-1):
        codes, scale = quantize(part)
        parts += [codes, scale.contiguous().view(torch.uint8)]
    return torch.cat(parts, dim=-1)


def unpack(packed: torch.Tensor, widths: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The values `pack` stored, [..., sum(widths)] in `dtype`."""
    out, offset = [], 0
    for width in widths:
        codes = packed[..., offset : offset + width]
        scale = packed[..., offset + width : offset + width + SCALE_BYTES].contiguous().view(torch.float32)
        out.append(dequantize(codes, scale, dtype))
        offset += width + SCALE_BYTES
    return torch.cat(out, dim=-1)
