"""The multi-tensor Triton kernels against their torch references, on CPU through Triton's interpreter,
and compiled for a GPU without one.

The kernels and references do the same fp32 operations in the same order (the interpreter does not fuse
multiply-adds, and GPU launches turn fusion off), so results are compared bit for bit (assert_identical). The interpreter's
cost is per program, so tensors are small and BLOCK is large enough for one program per tensor except the
one spanning blocks.
"""

import pytest
import torch

import torch_ext.kernels
from torch_ext._triton_kernels import multi_tensor_ref as ref
from torch_ext.testing import assert_identical

pytestmark = pytest.mark.triton

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Odd sizes, a zero-size tensor, a 2-D one, and one spanning two blocks.
SHAPES = [(123,), (0,), (7, 39), (1,), (1500,)]
BLOCK = 1024


def randn_list(dtype, shapes=SHAPES):
    return [torch.randn(shape).to(dtype) for shape in shapes]


@pytest.mark.parametrize("alpha", [1.0, -0.3])
@pytest.mark.parametrize("dst_dtype, src_dtype", [(FP32, FP32), (FP16, FP16), (BF16, BF16), (FP32, BF16), (BF16, FP32)])
def test_accumulate_matches_reference(multi_tensor, dst_dtype, src_dtype, alpha):
    dsts, srcs = randn_list(dst_dtype), randn_list(src_dtype)
    expected = [d.clone() for d in dsts]
    ref.accumulate_ref_(expected, srcs, alpha)
    multi_tensor.accumulate_(dsts, srcs, alpha, block_size=BLOCK)
    assert_identical(dsts, expected)


@pytest.mark.parametrize("n_inputs", [1, 2, 5])
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_sum_n_matches_reference(multi_tensor, dtype, n_inputs):
    tensors = randn_list(dtype, [(7, 273)] * n_inputs)
    assert_identical([multi_tensor.sum_n(tensors, block_size=BLOCK)], [ref.sum_n_ref(tensors)])


@pytest.mark.parametrize("scale", [1.0, 0.125, -3.7])
@pytest.mark.parametrize(
    "src_dtype, flat_dtype", [(FP32, FP32), (FP16, FP16), (BF16, BF16), (FP32, BF16), (BF16, FP32)]
)
def test_pack_matches_reference(multi_tensor, src_dtype, flat_dtype, scale):
    tensors = randn_list(src_dtype)
    actual = multi_tensor.pack(tensors, scale, flat_dtype, block_size=BLOCK)
    assert_identical([actual], [ref.pack_ref(tensors, scale, flat_dtype)])


def test_pack_of_mixed_dtypes_matches_reference(multi_tensor):
    tensors = [torch.randn(123).to(dtype) for dtype in (FP32, BF16, FP16, FP32)]
    actual = multi_tensor.pack(tensors, 0.5, FP16, block_size=BLOCK)
    assert_identical([actual], [ref.pack_ref(tensors, 0.5, FP16)])


@pytest.mark.parametrize("scale", [1.0, -3.7])
@pytest.mark.parametrize(
    "flat_dtype, out_dtype", [(FP32, FP32), (FP16, FP16), (BF16, BF16), (BF16, FP32), (FP32, FP16)]
)
def test_unpack_matches_reference(multi_tensor, flat_dtype, out_dtype, scale):
    outs = randn_list(out_dtype)
    flat = torch.randn(sum(o.numel() for o in outs)).to(flat_dtype)
    expected = [torch.empty_like(o) for o in outs]
    ref.unpack_ref_(flat, expected, scale)
    multi_tensor.unpack_(flat, outs, scale, block_size=BLOCK)
    assert_identical(outs, expected)


def test_unpack_undoes_pack(multi_tensor):
    tensors = randn_list(FP32)
    outs = [torch.empty_like(t) for t in tensors]
    multi_tensor.unpack_(multi_tensor.pack(tensors, 4.0, block_size=BLOCK), outs, 0.25, block_size=BLOCK)
    assert_identical(outs, tensors)


def test_default_block_size(multi_tensor):
    # The other tests use a smaller BLOCK to keep the interpreter fast; the default is what the GPU runs.
    dsts, srcs = randn_list(BF16, [(5000,), (123,)]), randn_list(BF16, [(5000,), (123,)])
    expected = [d.clone() for d in dsts]
    ref.accumulate_ref_(expected, srcs, 1.0)
    multi_tensor.accumulate_(dsts, srcs)
    assert_identical(dsts, expected)


def _fp32_from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(FP32)


def test_bf16_rounding_is_torchs(multi_tensor):
    # The kernels round fp32 -> bf16 by hand (the interpreter truncates): ties to even both ways,
    # overflow to inf, subnormals, signed zero, infinities.
    values = _fp32_from_bits(
        [0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x00000001, 0x00018000, 0x80000000]
        + [0x7F800000, 0xFF800000]
    )
    assert_identical([multi_tensor.pack([values], dtype=BF16, block_size=BLOCK)], [values.to(BF16)])


# The interpreter computes with numpy, which warns about NaN operands.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_bf16_rounding_keeps_nan(multi_tensor):
    # torch's NaN bits differ between its own paths (vectorized CPU 0xFFFF, scalar 0x7FC0); NaN stays NaN.
    nans = _fp32_from_bits([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001])
    assert multi_tensor.pack([nans], dtype=BF16, block_size=BLOCK).isnan().all()


def test_one_launch_per_dtype_pair(multi_tensor):
    shapes = [(17,)] * 40
    assert len(multi_tensor.plan_accumulate_(randn_list(FP32, shapes), randn_list(FP32, shapes))) == 1
    mixed_srcs = randn_list(FP32, shapes[:20]) + randn_list(BF16, shapes[20:])
    assert len(multi_tensor.plan_accumulate_(randn_list(FP32, shapes), mixed_srcs)) == 2
    assert multi_tensor.plan_accumulate_([], []) == []
    assert multi_tensor.plan_accumulate_(randn_list(FP32, [(0,), (3, 0)]), randn_list(FP32, [(0,), (3, 0)])) == []
    assert multi_tensor.plan_pack([], torch.empty(0)) == []


def test_launches_split_by_alignment(multi_tensor):
    # 128-bit accesses need every address of a launch at a multiple of 16 bytes: pieces of a flat buffer
    # after an odd-sized tensor are not.
    def aligned_flags(shapes):
        launches = multi_tensor.plan_pack(randn_list(FP32, shapes), torch.empty(_numel(shapes)))
        return [launch.kwargs["ALIGNED"] for launch in launches]

    assert aligned_flags([(128,), (64, 2)]) == [True]
    assert aligned_flags([(123,), (128,), (4,)]) == [True, False]
    assert aligned_flags([(1,)]) == [True]


def _numel(shapes):
    return sum(torch.Size(shape).numel() for shape in shapes)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda mt, x: mt.accumulate_([x, x.t()], [x, x]), r"dsts\[1\] is not contiguous"),
        (lambda mt, x: mt.accumulate_([x, x], [x, x[:, ::2].t()]), r"srcs\[1\] is not contiguous"),
        (lambda mt, x: mt.pack([x.t()]), r"tensors\[0\] is not contiguous"),
        (lambda mt, x: mt.unpack_(torch.empty(32)[::2], [x]), r"flat is not contiguous"),
        (lambda mt, x: mt.unpack_(torch.empty(16), [x.t()]), r"outs\[0\] is not contiguous"),
        (lambda mt, x: mt.sum_n([x, x.t()]), r"tensors\[1\] is not contiguous"),
        (lambda mt, x: mt.accumulate_([x.double()], [x.double()]), r"dtype torch.float64 is not supported"),
    ],
)
def test_launchers_reject_what_they_would_get_wrong(multi_tensor, call, message):
    with pytest.raises(ValueError, match=message):
        call(multi_tensor, torch.randn(4, 4))


# The ops' CUDA implementations, run on CPU tensors with the interpreted kernels: routing of non-contiguous
# tensors, the switch, and launch counts.


@pytest.fixture
def device_path(monkeypatch, multi_tensor):
    """Sends CPU tensors down the ops' CUDA path; yields the list of launch counts, one per kernel call."""
    monkeypatch.setattr(torch_ext.kernels, "_TRITON_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(torch_ext.kernels, "_multi_tensor_kernels", lambda: multi_tensor)
    launch_counts = []
    launch = torch_ext.kernels._launch

    def counting_launch(launches):
        launch_counts.append(len(launches))
        launch(launches)

    monkeypatch.setattr(torch_ext.kernels, "_launch", counting_launch)
    with torch_ext.kernels.set_triton_enabled(True):
        yield launch_counts


def test_device_path_handles_many_tensors_in_one_launch(device_path):
    shapes = [(i % 5 + 1, 7) for i in range(100)]
    dsts, srcs = randn_list(FP32, shapes), randn_list(BF16, shapes)
    expected = [d.clone() for d in dsts]
    ref.accumulate_ref_(expected, srcs, 1.0)
    torch_ext.kernels._multi_tensor_accumulate_on_device(dsts, srcs)
    assert_identical(dsts, expected)

    flat = torch.randn(sum(d.numel() for d in dsts)).to(BF16)
    ref.unpack_ref_(flat, expected, 4.0)
    torch_ext.kernels._unpack_on_device(flat, dsts, 4.0)
    assert_identical(dsts, expected)
    assert device_path == [1, 2]  # unpack: the pieces of flat at 16-byte multiples, and the others


def test_device_path_routes_non_contiguous_tensors(device_path):
    base = torch.randn(6, 10).to(BF16)
    dsts = [torch.randn(5, 3).to(BF16), base.t(), torch.randn(8).to(BF16)]  # dsts[1] is written by torch
    srcs = [torch.randn(3, 5).to(BF16).t(), torch.randn(10, 6).to(BF16), torch.randn(16).to(BF16)[::2]]
    expected = [d.clone() for d in dsts]
    ref.accumulate_ref_(expected, srcs, -0.3)
    torch_ext.kernels._multi_tensor_accumulate_on_device(dsts, srcs, -0.3)
    assert_identical(dsts, expected)

    tensors = [srcs[0], torch.randn(4).to(BF16), srcs[2]]
    assert_identical([torch_ext.kernels._pack_on_device(tensors, 2.0, FP32)], [ref.pack_ref(tensors, 2.0, FP32)])
    summands = [srcs[0], torch.randn(5, 3).to(BF16), dsts[0]]
    assert_identical([torch_ext.kernels._sum_n_on_device(summands)], [ref.sum_n_ref(summands)])

    outs = [torch.empty(3, 4), torch.empty(5, 6)[:, ::2], torch.empty(2, 0), torch.empty(7)]
    flat = torch.randn(12 + 15 + 7).to(BF16)
    # In the outputs' own layouts (empty_like would make the strided one contiguous): unpacking writes in place.
    expected = [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype) for o in outs]
    ref.unpack_ref_(flat, expected, 0.5)
    torch_ext.kernels._unpack_on_device(flat, outs, 0.5)
    assert_identical(outs, expected)
    assert len(device_path) == 4  # each call launched (the contiguous tensors), split at most by alignment


def test_device_path_switch_runs_the_reference(device_path):
    dsts, srcs = randn_list(FP16), randn_list(FP16)
    expected = [d.clone() for d in dsts]
    ref.accumulate_ref_(expected, srcs, 1.0)
    with torch_ext.kernels.set_triton_enabled(False):
        torch_ext.kernels._multi_tensor_accumulate_on_device(dsts, srcs)
        torch_ext.kernels._pack_on_device(srcs)
    assert device_path == []
    assert_identical(dsts, expected)


def test_device_path_under_compile_decomposes_into_the_reference(device_path):
    # Tracing hands the implementations fake and functional tensors, which have no addresses for a table.
    def step(dsts, srcs):
        torch_ext.kernels.multi_tensor_accumulate_(dsts, srcs, 0.5)
        return torch_ext.kernels.pack(srcs, 2.0)

    dsts, srcs = randn_list(FP32, [(3, 5), (7,)]), randn_list(FP32, [(3, 5), (7,)])
    expected_dsts = [d.clone() for d in dsts]
    ref.accumulate_ref_(expected_dsts, srcs, 0.5)
    flat = torch.compile(step, fullgraph=True, backend="aot_eager")(dsts, srcs)
    assert_identical(dsts + [flat], expected_dsts + [ref.pack_ref(srcs, 2.0)])
    assert device_path == []


# The kernels compiled for a GPU (sm_80) without one: Triton's code generator and ptxas accept them, and the
# full blocks of aligned tensors are read and written with 128-bit accesses (the interpreter ignores both).


def _ptx(kernel, signature, constexprs):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        fn=kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs
    )
    asm = triton.compile(source, target=GPUTarget("cuda", 80, 32), options={"enable_fp_fusion": False}).asm
    assert "cubin" in asm
    return asm["ptx"]


@pytest.mark.parametrize(
    "dst_dtype, src_dtype, accumulate, aligned",
    [(FP32, FP32, True, True), (BF16, BF16, True, True), (BF16, FP32, False, True), (FP16, BF16, False, False)],
)
def test_scale_kernel_compiles_for_sm80(compiled_multi_tensor, dst_dtype, src_dtype, accumulate, aligned):
    to_triton = compiled_multi_tensor._TRITON_DTYPES
    ptx = _ptx(
        compiled_multi_tensor._multi_tensor_scale_kernel,
        {"table_ptr": "*i64", "n_tensors": "i32", "n_blocks": "i32", "scale": "fp32"},
        {
            "DST_DTYPE": to_triton[dst_dtype],
            "SRC_DTYPE": to_triton[src_dtype],
            "ACCUMULATE": accumulate,
            "ALIGNED": aligned,
            "BLOCK": 4096,
        },
    )
    assert ("ld.global.v4" in ptx) == aligned


def test_sum_n_kernel_compiles_for_sm80(compiled_multi_tensor):
    ptx = _ptx(
        compiled_multi_tensor._sum_n_kernel,
        {"table_ptr": "*i64", "out_ptr": "*bf16", "n_inputs": "i32", "numel": "i64"},
        {"DTYPE": compiled_multi_tensor._TRITON_DTYPES[BF16], "ALIGNED": True, "BLOCK": 4096},
    )
    assert "ld.global.v4" in ptx
