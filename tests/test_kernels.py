"""ddl_magic.kernels: what pack, unpack, reduce_, compress and decompress do.

The first half specifies behaviour on the torch reference backend. The second
half checks the Triton kernels against that reference, element for element:
compiled on CUDA when a GPU is present, otherwise run by Triton's interpreter
on CPU tensors.
"""

import doctest
import importlib
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton decides interpreted-or-compiled when a kernel is decorated, and
    # rereads the variable later, so it is set before ddl_magic.kernels
    # imports triton and left set. Only the Triton backend reads it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ddl_magic import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_DTYPES = [
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
]
REDUCE_DTYPES = [
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64,
]
# (tensor dtype, buffer dtype): compression and the widening/narrowing it implies.
CAST_PAIRS = [
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float64, torch.float16),
    (torch.float64, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float16),
]
SCALES = [1.0, 0.37]


@pytest.fixture
def on_torch(monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_KERNELS", "torch")


@pytest.fixture
def use_backend(monkeypatch):
    """Switch backends within a test: ``use_backend("triton")``, then ``use_backend("torch")``."""
    pytest.importorskip("triton")
    from ddl_magic.kernels import triton_kernels

    if triton_kernels.INTERPRETED != (DEVICE == "cpu"):
        pytest.skip("triton_kernels was imported before this module could set TRITON_INTERPRET")
    return lambda backend: monkeypatch.setenv("DDL_MAGIC_KERNELS", backend)


def scattered(dtype, count=50, max_size=2500, seed=0, device=DEVICE):
    """``count`` contiguous tensors cut from one storage with 1-7 element gaps.

    The gaps give the data pointers every alignment; sizes include 0, 1, a
    0-dim tensor and sizes that are not a multiple of any block. Returns the
    storage (gaps included) and the tensors.
    """
    generator = torch.Generator().manual_seed(seed)
    layout, end = [], 0
    for index in range(count):
        end += int(torch.randint(1, 8, (), generator=generator))
        size = int(torch.randint(0, max_size, (), generator=generator))
        shape = {0: (0,), 1: (), 2: (1,)}.get(index, (size // 3, 3) if index % 2 else (size,))
        layout.append((end, shape))
        end += torch.Size(shape).numel()
    storage = random_values(dtype, end + 8, generator).to(device)
    return storage, [storage[start:start + torch.Size(shape).numel()].view(shape) for start, shape in layout]


def random_values(dtype, count, generator):
    if dtype.is_floating_point:
        return (torch.randn(count, generator=generator, dtype=torch.float64) * 50).to(dtype)
    low, high = (0, 250) if dtype == torch.uint8 else (-120, 120)
    return torch.randint(low, high, (count,), generator=generator, dtype=dtype)


def cpu_copies(storage, tensors):
    """The same layout on a CPU clone of ``storage``."""
    copy = storage.cpu().clone()
    base = storage.data_ptr()
    size = storage.element_size()
    return copy, [copy[(t.data_ptr() - base) // size:][: t.numel()].view(t.shape) for t in tensors]


def assert_same(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


# Reference backend: the specification.


def test_pack_lays_tensors_end_to_end_and_returns_the_filled_prefix(on_torch):
    out = torch.full((8,), -1.0)
    packed = kernels.pack([torch.tensor([1.0, 2.0]), torch.tensor([[3.0], [4.0]]), torch.tensor(5.0)], out)
    assert packed.data_ptr() == out.data_ptr()
    assert out.tolist() == [1, 2, 3, 4, 5, -1, -1, -1]
    assert packed.tolist() == [1, 2, 3, 4, 5]


def test_pack_multiplies_by_prescale(on_torch):
    assert kernels.pack([torch.tensor([2.0, 4.0])], torch.empty(2), prescale=0.25).tolist() == [0.5, 1.0]


def test_unpack_writes_each_tensor_in_place_with_postscale(on_torch):
    first, second = torch.zeros(2), torch.zeros(1, 2)
    kernels.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0, 99.0]), [first, second], postscale=2.0)
    assert first.tolist() == [2.0, 4.0]
    assert second.tolist() == [[6.0, 8.0]]


def test_unpack_undoes_pack(on_torch):
    storage, tensors = scattered(torch.float32, count=20, device="cpu")
    originals = [t.clone() for t in tensors]
    buffer = kernels.pack(tensors, torch.empty(storage.numel()))
    for t in tensors:
        t.zero_()
    kernels.unpack(buffer, tensors)
    for t, original in zip(tensors, originals, strict=True):
        assert_same(t, original)


def test_integers_scale_in_float64_and_round_toward_zero(on_torch):
    values = torch.tensor([-7, 7, 3], dtype=torch.int32)
    assert kernels.pack([values], torch.empty(3, dtype=torch.int32), prescale=0.5).tolist() == [-3, 3, 1]


def test_integers_copy_exactly_when_the_scale_is_one(on_torch):
    big = torch.tensor([2**60 + 1], dtype=torch.int64)
    assert kernels.pack([big], torch.empty(1, dtype=torch.int64)).item() == 2**60 + 1


def test_compression_scales_before_rounding(on_torch):
    # 131072 overflows float16; scaled first, it fits.
    packed = kernels.pack([torch.tensor([131072.0])], torch.empty(1, dtype=torch.float16), prescale=0.25)
    assert packed.item() == 32768.0


def test_decompression_scales_after_widening(on_torch):
    grads = [torch.zeros(1)]
    kernels.unpack(torch.tensor([60000.0], dtype=torch.float16), grads, postscale=4.0)
    assert grads[0].item() == 240000.0  # beyond float16's range, fine in float32


def test_compress_and_decompress_round_trip_through_float16(on_torch):
    source = torch.tensor([[1.5, -2.0], [1000.0, 0.25]])
    compressed = kernels.compress(source, torch.float16, scale=0.5)
    assert compressed.dtype == torch.float16 and compressed.shape == source.shape
    assert_same(kernels.decompress(compressed, torch.empty(4), scale=2.0), source.view(-1))


@pytest.mark.parametrize("tensor_dtype, buffer_dtype", [(torch.float32, torch.float32)] + CAST_PAIRS, ids=str)
def test_inputs_are_never_modified(on_torch, tensor_dtype, buffer_dtype):
    tensors = [torch.tensor([1.5, -3.0], dtype=tensor_dtype), torch.tensor([[7.0]], dtype=tensor_dtype)]
    kernels.pack(tensors, torch.empty(3, dtype=buffer_dtype), prescale=0.5)
    assert tensors[0].tolist() == [1.5, -3.0] and tensors[1].item() == 7.0

    buffer = torch.tensor([1.5, -3.0, 7.0], dtype=buffer_dtype)
    kernels.unpack(buffer, tensors, postscale=0.5)
    assert buffer.tolist() == [1.5, -3.0, 7.0]

    kernels.compress(buffer, tensor_dtype, scale=0.5)
    assert buffer.tolist() == [1.5, -3.0, 7.0]


@pytest.mark.parametrize(
    "op, expected", [("sum", [4, 7]), ("product", [3, 10]), ("min", [1, 2]), ("max", [3, 5])]
)
def test_reduce_combines_dst_with_src_in_place(on_torch, op, expected):
    dst = torch.tensor([1, 5], dtype=torch.int32)
    kernels.reduce_(dst, torch.tensor([3, 2], dtype=torch.int32), op)
    assert dst.tolist() == expected


def test_reduce_min_and_max_propagate_nan(on_torch):
    for op in ("min", "max"):
        dst = torch.tensor([float("nan"), 1.0])
        kernels.reduce_(dst, torch.tensor([0.0, float("nan")]), op)
        assert dst.isnan().all()


def test_backend_is_torch_for_cpu_tensors_unless_forced(monkeypatch):
    monkeypatch.delenv("DDL_MAGIC_KERNELS", raising=False)
    assert kernels.backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv("DDL_MAGIC_KERNELS", "triton")
    assert kernels.backend_for(torch.zeros(1)) == "triton"
    monkeypatch.setenv("DDL_MAGIC_KERNELS", "cuda")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        kernels.backend_for(torch.zeros(1))


def test_importing_kernels_does_not_import_triton():
    code = "import sys, ddl_magic.kernels; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("module", ["", ".casting", ".dispatch", ".segment_table"])
def test_docstring_examples_hold(on_torch, module):
    results = doctest.testmod(importlib.import_module("ddl_magic.kernels" + module))
    assert results.attempted > 0 and results.failed == 0


@pytest.mark.parametrize(
    "tensors, out, message",
    [
        ([torch.zeros(2), torch.zeros(2, dtype=torch.int8)], torch.zeros(4), r"tensors\[1\] is torch.int8"),
        ([torch.zeros(2, 2).t()], torch.zeros(4), r"tensors\[0\] is not contiguous"),
        ([torch.zeros(5)], torch.zeros(4), "allocate at least 5"),
        ([torch.zeros(2)], torch.zeros(2, 2), "1-D contiguous"),
        ([torch.zeros(2, dtype=torch.int32)], torch.zeros(2), "only float dtypes convert"),
        ([torch.zeros(2, dtype=torch.bool)], torch.zeros(2, dtype=torch.bool), "not supported"),
    ],
)
def test_pack_rejects_bad_arguments_before_copying(on_torch, tensors, out, message):
    with pytest.raises((TypeError, ValueError), match=message):
        kernels.pack(tensors, out)


def test_reduce_rejects_unknown_ops_and_mixed_dtypes(on_torch):
    with pytest.raises(ValueError, match="use one of sum, min, max, product"):
        kernels.reduce_(torch.zeros(2), torch.zeros(2), "mean")
    with pytest.raises(TypeError, match="cast src first"):
        kernels.reduce_(torch.zeros(2), torch.zeros(2, dtype=torch.float16), "sum")


# Triton backend: element for element against the reference (on CPU copies).


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_triton_pack_matches_reference(use_backend, dtype, scale):
    storage, tensors = scattered(dtype)
    _, cpu_tensors = cpu_copies(storage, tensors)
    out = torch.zeros(storage.numel(), dtype=dtype, device=DEVICE)

    use_backend("triton")
    packed = kernels.pack(tensors, out, scale)
    use_backend("torch")
    expected = kernels.pack(cpu_tensors, torch.zeros(storage.numel(), dtype=dtype), scale)

    assert_same(packed, expected)
    assert not out[packed.numel():].any()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_triton_unpack_matches_reference_and_leaves_gaps_alone(use_backend, dtype, scale):
    storage, tensors = scattered(dtype, seed=1)
    cpu_storage, cpu_tensors = cpu_copies(storage, tensors)
    buffer = random_values(dtype, storage.numel(), torch.Generator().manual_seed(2))

    use_backend("triton")
    kernels.unpack(buffer.to(DEVICE), tensors, scale)
    use_backend("torch")
    kernels.unpack(buffer, cpu_tensors, scale)

    assert_same(storage, cpu_storage)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("tensor_dtype, buffer_dtype", CAST_PAIRS, ids=str)
def test_triton_pack_and_unpack_convert_like_reference(use_backend, tensor_dtype, buffer_dtype, scale):
    storage, tensors = scattered(tensor_dtype, count=20, seed=3)
    cpu_storage, cpu_tensors = cpu_copies(storage, tensors)
    out = torch.empty(storage.numel(), dtype=buffer_dtype)

    use_backend("triton")
    packed = kernels.pack(tensors, out.to(DEVICE), scale)
    use_backend("torch")
    expected = kernels.pack(cpu_tensors, out, scale)
    assert_same(packed, expected)

    use_backend("triton")
    kernels.unpack(packed, tensors, 1 / scale)
    use_backend("torch")
    kernels.unpack(expected, cpu_tensors, 1 / scale)
    assert_same(storage, cpu_storage)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("source_dtype, dtype", CAST_PAIRS, ids=str)
def test_triton_compress_and_decompress_match_reference(use_backend, source_dtype, dtype, scale):
    source = random_values(source_dtype, 7 * 715, torch.Generator().manual_seed(4)).view(7, 715)

    use_backend("triton")
    compressed = kernels.compress(source.to(DEVICE), dtype, scale)
    restored = kernels.decompress(compressed, torch.empty_like(source, device=DEVICE), 1 / scale)
    use_backend("torch")
    expected = kernels.compress(source, dtype, scale)
    expected_restored = kernels.decompress(expected, torch.empty_like(source), 1 / scale)

    assert_same(compressed, expected)
    assert_same(restored, expected_restored)


@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=str)
def test_triton_reduce_matches_reference(use_backend, dtype, op):
    generator = torch.Generator().manual_seed(5)
    dst, src = (random_values(dtype, 5003, generator) for _ in range(2))
    if dtype.is_floating_point:
        dst[::97], src[::89] = float("nan"), float("nan")
    on_device = dst.to(DEVICE)

    use_backend("triton")
    kernels.reduce_(on_device, src.to(DEVICE), op)
    use_backend("torch")
    kernels.reduce_(dst, src, op)

    assert_same(on_device, dst)


def test_triton_skips_empty_tensors_and_empty_lists(use_backend):
    use_backend("triton")
    tensors = [torch.zeros(0, device=DEVICE), torch.ones(3, device=DEVICE), torch.zeros(0, 4, device=DEVICE)]
    out = torch.zeros(4, device=DEVICE)
    assert kernels.pack(tensors, out, 2.0).tolist() == [2.0, 2.0, 2.0]
    assert kernels.pack([], out).numel() == 0
    assert kernels.pack(tensors[:1], out).numel() == 0
    kernels.unpack(out, [torch.zeros(0, device=DEVICE)])
