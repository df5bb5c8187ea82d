"""Torch dequantizers against the gguf package's numpy reference, bit for bit."""
import numpy as np
import pytest
import torch
from gguf import quants as ref_quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from alphallama.gguf.quants import (
    CPU_CHUNK_VALUES,
    QUANTS,
    RANDOM_WEIGHT_MAX,
    dequantize,
    random_blocks,
)

TYPES = list(QUANTS)
IDS = [t.name for t in TYPES]
FLOATS = (T.F32, T.F16, T.BF16)

# (bits dtype, exponent mask, a bit of the exponent): a value is inf/nan exactly when
# its exponent is all ones, so clearing that bit makes any pattern finite
_EXP = {T.F32: (torch.int32, 0x7F800000, 0x40000000),
        T.F16: (torch.int16, 0x7C00, 0x4000),
        T.BF16: (torch.int16, 0x7F80, 0x4000)}


# IQ1_M splits its fp16 d over the top nibbles of four u16 words; d's exponent bit 14
# is bit 6 of the block's last byte, and clearing it makes d finite
_SPLIT_D_EXP = {T.IQ1_M: (55, 0x40)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_bytes(qtype, n_blocks, g, finite: bool) -> torch.Tensor:
    """Fully random blocks; with finite=True every float field (fp16 scales, or the
    value of a float type) is made finite, the other bits stay random."""
    q = QUANTS[qtype]
    blocks = torch.randint(0, 256, (n_blocks, q.type_size), dtype=torch.uint8, generator=g)  # [n, type_size]
    if finite:
        fields = [(0, _EXP[qtype])] if qtype in FLOATS else [(o, _EXP[T.F16]) for o in q.f16_fields]
        for offset, (dtype, exp, bit) in fields:
            width = torch.empty((), dtype=dtype).element_size()
            field = blocks[:, offset:offset + width].contiguous().view(dtype)  # [n, 1]
            field = torch.where(field & exp == exp, field & ~bit, field)
            blocks[:, offset:offset + width] = field.view(torch.uint8)
        if qtype in _SPLIT_D_EXP:
            byte, bit = _SPLIT_D_EXP[qtype]
            blocks[:, byte] &= ~bit & 0xFF
    return blocks


def _reference(raw: np.ndarray, qtype) -> torch.Tensor:
    """gguf's numpy dequantizer on uint8 [..., row_bytes]; inf/nan warnings are expected."""
    with np.errstate(all="ignore"):
        out = ref_quants.dequantize(raw, qtype)
    assert out.dtype == np.float32
    return torch.from_numpy(np.ascontiguousarray(out))


def _assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same NaN positions, and every other value identical to the bit (so -0.0 != 0.0)."""
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def test_registry_matches_gguf_sizes():
    assert set(QUANTS) == {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                           T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                           T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S,
                           T.IQ1_S, T.IQ1_M, T.MXFP4, T.TQ1_0, T.TQ2_0}
    for qtype, q in QUANTS.items():
        assert q.qtype == qtype
        assert (q.block_size, q.type_size) == GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("n_blocks", [1, 5, 67])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_random_bytes_with_finite_scales(qtype, n_blocks):
    q = QUANTS[qtype]
    blocks = _random_bytes(qtype, n_blocks, _gen(n_blocks), finite=True)  # [n, type_size]
    ref = _reference(blocks.numpy(), qtype).reshape(n_blocks, q.block_size)
    assert not ref.isnan().any()
    _assert_bits_equal(q.dequantize_blocks(blocks), ref)
    _assert_bits_equal(dequantize(blocks, qtype, (n_blocks * q.block_size,)), ref.reshape(-1))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_entirely_random_bytes(qtype):
    q = QUANTS[qtype]
    n_blocks = 4096 if qtype in FLOATS + (T.MXFP4,) else 300   # enough to hit inf/nan scales
    blocks = _random_bytes(qtype, n_blocks, _gen(1), finite=False)
    ref = _reference(blocks.numpy(), qtype).reshape(n_blocks, q.block_size)
    # the case this test exists for (MXFP4's scale byte has no NaN: 255 is 2^127, x 12 is inf)
    assert (~ref.isfinite()).any() if qtype == T.MXFP4 else ref.isnan().any()
    _assert_bits_equal(q.dequantize_blocks(blocks), ref)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_random_blocks_exact_finite_bounded(qtype):
    q = QUANTS[qtype]
    blocks = random_blocks(qtype, 2000, _gen(2))
    assert blocks.dtype == torch.uint8 and blocks.shape == (2000, q.type_size)
    ref = _reference(blocks.numpy(), qtype).reshape(2000, q.block_size)
    ours = q.dequantize_blocks(blocks)
    _assert_bits_equal(ours, ref)
    assert torch.isfinite(ours).all()
    assert ours.abs().max() <= 1.5 * RANDOM_WEIGHT_MAX
    assert 0.01 < ours.std() < 0.06        # weight-like spread, not degenerate
    assert ours.mean().abs() < 0.005       # centred on zero
    assert torch.equal(random_blocks(qtype, 2000, _gen(2)), blocks)   # seeded


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_expert_tensor_shapes_and_raw_forms(qtype):
    """A 3-D [experts, rows, cols] tensor, its bytes handed over in every accepted form."""
    q = QUANTS[qtype]
    shape = (3, 5, 2 * max(q.block_size, 32))
    n_blocks = 3 * 5 * shape[2] // q.block_size
    blocks = random_blocks(qtype, n_blocks, _gen(3))
    rows = blocks.numpy().reshape(3, 5, -1)   # how the reader hands block formats over
    ref = _reference(rows, qtype)
    assert ref.shape == shape

    readonly = rows.copy()
    readonly.flags.writeable = False          # an mmap'd file
    forms = [blocks, blocks.reshape(-1), rows, readonly, torch.from_numpy(rows)]
    if qtype in FLOATS:                       # typed views, as the reader gives floats
        np_dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[qtype]
        torch_dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        forms += [rows.view(np_dtype).reshape(shape), blocks.view(torch_dtype).reshape(shape)]
    for raw in forms:
        out = dequantize(raw, qtype, shape)
        _assert_bits_equal(out, ref)

    out = dequantize(blocks, qtype, shape)
    out.fill_(1.0)                            # the result never aliases the input bytes
    _assert_bits_equal(dequantize(blocks, qtype, shape), ref)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ2_XXS, T.MXFP4], ids=["Q4_K", "IQ2_XXS", "MXFP4"])
def test_chunked_cpu_path(qtype):
    """A tensor larger than one CPU step (CPU_CHUNK_VALUES), its last step partial."""
    q = QUANTS[qtype]
    shape = (5, CPU_CHUNK_VALUES * torch.get_num_threads() // 4 + 256)
    blocks = random_blocks(qtype, shape[0] * shape[1] // q.block_size, _gen(5))
    _assert_bits_equal(dequantize(blocks, qtype, shape), _reference(blocks.numpy().reshape(5, -1), qtype))


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="Q8_K"):
        dequantize(np.zeros(292, np.uint8), T.Q8_K, (256,))
    with pytest.raises(ValueError, match="NVFP4"):
        random_blocks(T.NVFP4, 1, _gen(0))


def test_size_mismatches_raise():
    with pytest.raises(ValueError, match="block size"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (1, 16))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(35, np.uint8), T.Q8_0, (1, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_cuda_matches_cpu(qtype):
    q = QUANTS[qtype]
    blocks = _random_bytes(qtype, 300, _gen(4), finite=False)
    shape = (300 * q.block_size,)
    _assert_bits_equal(dequantize(blocks.cuda(), qtype, shape).cpu(), dequantize(blocks, qtype, shape))
