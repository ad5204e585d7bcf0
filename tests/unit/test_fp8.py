"""parity/fp8.py: FP8 cache entries. Our encoder is round-to-nearest-even e4m3fn (checked against
torch's own float8_e4m3fn conversion, an independent implementation, on every in-range value
class and on every tie), the per-token scale is the smallest fitting power of two, decoding is
exact, and a row's bits do not depend on the other rows, the batch or the thread count."""

from __future__ import annotations

import pytest
import torch

from parity import fp8


def _ladder() -> torch.Tensor:
    """Every e4m3fn value, every midpoint between neighbours (the ties), and points just off
    each midpoint, positive and negative: every rounding case of the format."""
    values = fp8.decode_e4m3(torch.arange(256, dtype=torch.uint8))
    finite = values[~torch.isnan(values)].unique().sort().values
    finite = finite[finite >= 0]
    mids = (finite[1:] + finite[:-1]) / 2  # exact: neighbours differ by one ulp of e4m3
    off = torch.cat([torch.nextafter(mids, torch.full_like(mids, 0.0)),
                     torch.nextafter(mids, torch.full_like(mids, 1e3))])
    grid = torch.cat([finite, mids, off, torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 448])
    return torch.cat([grid, -grid])


def test_encoding_is_round_to_nearest_even_like_torch():
    y = _ladder()
    ours = fp8.encode_e4m3(y)
    reference = y.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, reference)


def test_every_code_decodes_and_encodes_back():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[~torch.isnan(fp8.decode_e4m3(codes))]
    assert finite.numel() == 254
    assert torch.equal(fp8.encode_e4m3(fp8.decode_e4m3(finite)), finite)
    assert fp8.decode_e4m3(torch.tensor([126], dtype=torch.uint8)).item() == fp8.E4M3_MAX
    assert fp8.encode_e4m3(torch.tensor([float("nan")])).item() == fp8.NAN_CODE


@pytest.mark.parametrize("amax", [1e-30, 0.3, 1.0, 0.875 * 2**9, 448.0000305, 3.0, 1e30])
def test_scale_is_the_smallest_power_of_two_that_fits(amax):
    x = torch.tensor([[amax, -amax / 3, 0.0]])
    t = fp8.token_scale_exponent(x).item()
    assert amax <= fp8.E4M3_MAX * 2.0**t and amax > fp8.E4M3_MAX * 2.0 ** (t - 1)
    assert fp8.power_of_two(torch.tensor([t])).item() == 2.0**t


def test_zero_rows_stay_zero():
    codes, scale = fp8.quantize(torch.zeros(3, 16))
    assert torch.equal(fp8.dequantize(codes, scale, torch.float32), torch.zeros(3, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_bounded_and_decoding_is_exact_in_the_model_dtype(dtype):
    x = (torch.randn(64, 576, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    codes, scale = fp8.quantize(x)
    exact = fp8.decode_e4m3(codes) * scale
    back = fp8.dequantize(codes, scale, dtype)
    assert torch.equal(back.float(), exact)  # no rounding after the e4m3 rounding
    # Relative step of e4m3 is 2^-3 for normals; below the normal range the step is 2^-9 * scale.
    error = (back.float() - x.float()).abs()
    assert torch.all(error <= torch.maximum(x.float().abs() * 2**-4, scale * 2**-10))
    assert torch.all(back.float().abs().amax(-1, keepdim=True) <= fp8.E4M3_MAX * scale)


def test_a_rows_bits_do_not_depend_on_the_batch_or_threads():
    x = torch.randn(33, 200, generator=torch.Generator().manual_seed(2))
    whole = fp8.fake_quantize(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows = torch.cat([fp8.fake_quantize(x[i:i + 1]) for i in range(33)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, rows)
    assert torch.equal(fp8.fake_quantize(x[5:17]), whole[5:17])


def test_fake_quantize_passes_the_gradient_straight_through():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = fp8.fake_quantize(x)
    assert not torch.equal(y, x)  # the quantization acts
    (y * torch.arange(32.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(32.0).expand(4, 32))


def test_entry_bytes():
    # MLA latent + RoPE key (512 + 64) and an index key (128): FP8 vs bf16, per token and layer.
    assert (fp8.entry_bytes(576, "fp8"), fp8.entry_bytes(576, "bf16")) == (580, 1152)
    assert (fp8.entry_bytes(128, "fp8"), fp8.entry_bytes(128, "bf16")) == (132, 256)


def test_quantizing_a_quantized_entry_gives_its_values_back():
    # A reader may quantize what it got back (a cache entry written again): same values, even
    # where the row's largest value rounded down to the next smaller scale's range.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 96, generator=g) * torch.rand(256, 1, generator=g) * 1e3
    x[0] = x[0] / x[0].abs().max() * 200
    x[0, 0] = 225.0  # the row's largest rounds down to 224 = 448 / 2: the scale halves on the second pass
    once = fp8.fake_quantize(x)
    assert torch.equal(fp8.fake_quantize(once), once)
    assert fp8.token_scale_exponent(once[:1]).item() == fp8.token_scale_exponent(x[:1]).item() - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_entries_unpack_to_the_fake_quantized_values(dtype):
    # An MLA entry: latent + RoPE key under one scale, the index key under its own.
    widths = (40, 12)
    g = torch.Generator().manual_seed(5)
    entry = (torch.randn(3, 7, 52, generator=g) * torch.tensor([1.0] * 40 + [1e-3] * 12)).to(dtype)
    rounded = fp8.fake_quantize_groups(entry, widths)
    packed = fp8.pack(rounded, widths)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 7, fp8.packed_bytes(widths)) == (3, 7, 60)
    assert torch.equal(fp8.unpack(packed, widths, dtype), rounded)
    # Each group has its own scale: the small index key is not flushed by the latent's range.
    assert torch.all(rounded[..., 40:] != 0)
