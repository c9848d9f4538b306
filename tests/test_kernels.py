"""torch_ext's multi-tensor ops (torch_ext/kernels.py): registration, semantics, errors, compile.

On CPU the ops run the torch references; their Triton kernels are checked against the same references
under Triton's interpreter in tests/triton/. The CUDA tests at the end need a GPU.
"""

import functools
import os
import subprocess
import sys

import pytest
import torch

from torch_ext import kernels

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [FP32, FP16, BF16]
SHAPES = [(123,), (0,), (7, 39), (1,), (2, 0, 3)]
OPS = torch.ops.torch_ext
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def randn_list(dtype, shapes=SHAPES, device="cpu", requires_grad=False):
    return [torch.randn(shape, device=device).to(dtype).requires_grad_(requires_grad) for shape in shapes]


# opcheck: schema and declared mutations, fake tensors, autograd registration, AOT dispatch.


@pytest.mark.parametrize(
    "dsts, srcs, alpha",
    [
        (randn_list(FP32), randn_list(FP32), 1.0),
        (randn_list(FP16), randn_list(FP16), -0.5),
        (randn_list(BF16), randn_list(FP32), 2.0),
        ([], [], 1.0),
        ([torch.empty(0)], [torch.empty(0)], 1.0),
    ],
    ids=["fp32", "fp16", "bf16+=fp32", "empty", "zero-size"],
)
def test_opcheck_multi_tensor_accumulate_(dsts, srcs, alpha):
    torch.library.opcheck(OPS.multi_tensor_accumulate_, (dsts, srcs, alpha))


@pytest.mark.parametrize(
    "tensors",
    [
        randn_list(FP32, [(3, 5)] * 3, requires_grad=True),
        randn_list(FP16, [(7,)]),
        randn_list(BF16, [(4, 2)] * 2, requires_grad=True),
        randn_list(FP32, [(0, 3)] * 2),
    ],
    ids=["fp32", "fp16-one", "bf16", "zero-size"],
)
def test_opcheck_sum_n(tensors):
    torch.library.opcheck(OPS.sum_n, (tensors,))


@pytest.mark.parametrize(
    "tensors, scale, dtype",
    [
        (randn_list(FP32, requires_grad=True), 1.0, None),
        (randn_list(FP16), 0.25, None),
        (randn_list(FP32, requires_grad=True), 0.5, BF16),
        ([torch.randn(3).to(d) for d in DTYPES], 1.0, FP32),
        ([], 1.0, None),
        ([], 1.0, FP16),
        ([torch.empty(0, 4)], 1.0, None),
    ],
    ids=["fp32", "fp16-scaled", "fp32-to-bf16", "mixed", "empty", "empty-fp16", "zero-size"],
)
def test_opcheck_pack(tensors, scale, dtype):
    torch.library.opcheck(OPS.pack, (tensors, scale, dtype))


@pytest.mark.parametrize(
    "flat, outs, scale",
    [
        (torch.randn(8), [torch.empty(2, 3), torch.empty(0), torch.empty(2)], 1.0),
        (torch.randn(8).to(BF16), [torch.empty(5), torch.empty(3).to(FP16)], -2.0),
        (torch.empty(0), [], 1.0),
        (torch.empty(0).to(FP16), [torch.empty(0, 3).to(FP16)], 1.0),
    ],
    ids=["fp32", "bf16-to-mixed", "empty", "zero-size"],
)
def test_opcheck_unpack_(flat, outs, scale):
    torch.library.opcheck(OPS.unpack_, (flat, outs, scale))


# Semantics, checked against plain torch written out (on CPU the ops are the references, so comparing
# with those would prove nothing).


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_with_alpha_one_is_stock_gradient_accumulation(dtype):
    # Stock AccumulateGrad does `grad += new_grad`; for the same inputs the op gives the same bits.
    dsts, srcs = randn_list(dtype), randn_list(dtype)
    expected = [d + s for d, s in zip(dsts, srcs)]
    kernels.multi_tensor_accumulate_(dsts, srcs)
    for actual, e in zip(dsts, expected):
        assert torch.equal(actual, e)


@pytest.mark.parametrize("dst_dtype, src_dtype", [(FP32, FP32), (FP16, FP16), (BF16, BF16), (FP32, BF16)])
def test_accumulate_scales_in_fp32(dst_dtype, src_dtype):
    # Unlike torch's add_(src, alpha=...), which on CPU rounds alpha to a 16-bit dtype when both operands
    # are 16-bit and fuses the multiply-add in fp32.
    dsts, srcs = randn_list(dst_dtype), randn_list(src_dtype)
    expected = [(d.float() + (-0.3 * s.float())).to(dst_dtype) for d, s in zip(dsts, srcs)]
    kernels.multi_tensor_accumulate_(dsts, srcs, -0.3)
    for actual, e in zip(dsts, expected):
        assert torch.equal(actual, e)


def test_accumulate_into_non_contiguous_tensors():
    grad_buffer = torch.zeros(4, 10)
    dsts = [grad_buffer[:, :6].t(), grad_buffer[:, 6:]]  # views into one buffer, one transposed
    srcs = [torch.randn(6, 4), torch.randn(4, 4).t()]
    kernels.multi_tensor_accumulate_(dsts, srcs, 2.0)
    assert torch.equal(grad_buffer, torch.cat([2.0 * srcs[0].t(), 2.0 * srcs[1]], dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_n_adds_in_order_in_fp32(dtype):
    tensors = randn_list(dtype, [(5, 37)] * 5)
    fp32_sum = functools.reduce(torch.add, [t.float() for t in tensors])
    assert torch.equal(kernels.sum_n(tensors), fp32_sum.to(dtype))
    if dtype == FP32:  # what stock's input buffer computes for gradients arriving on one input
        assert torch.equal(kernels.sum_n(tensors), functools.reduce(torch.add, tensors))


def test_sum_n_of_non_contiguous_tensors_is_contiguous():
    tensors = [torch.randn(3, 4).t(), torch.randn(4, 6)[:, ::2], torch.randn(4, 3)]
    total = kernels.sum_n(tensors)
    assert total.is_contiguous()
    assert torch.equal(total, tensors[0] + tensors[1] + tensors[2])


@pytest.mark.parametrize("src_dtype, flat_dtype", [(FP32, FP32), (FP16, FP16), (FP32, BF16), (BF16, FP32)])
def test_pack_is_cat_of_flattened_tensors(src_dtype, flat_dtype):
    tensors = randn_list(src_dtype) + [torch.randn(4, 3).to(src_dtype).t()]
    cat = torch.cat([t.reshape(-1) for t in tensors])
    assert torch.equal(kernels.pack(tensors, dtype=flat_dtype), cat.to(flat_dtype))
    assert torch.equal(kernels.pack(tensors, 0.125, flat_dtype), (cat.float() * 0.125).to(flat_dtype))


def test_pack_of_empty_list_is_empty_cpu_tensor():
    assert kernels.pack([]).shape == (0,) and kernels.pack([]).dtype == FP32
    assert kernels.pack([], dtype=BF16).dtype == BF16


@pytest.mark.parametrize("flat_dtype, out_dtype", [(FP32, FP32), (BF16, BF16), (BF16, FP32), (FP32, FP16)])
def test_unpack_fills_views_in_order(flat_dtype, out_dtype):
    buffer = torch.zeros(5, 8, dtype=out_dtype)
    outs = [buffer[:, :3], torch.empty(0, dtype=out_dtype), buffer[:, 3:].t()]
    flat = torch.randn(40).to(flat_dtype)
    kernels.unpack_(flat, outs, -2.0)
    scaled = (flat.float() * -2.0).to(out_dtype)
    assert torch.equal(buffer[:, :3], scaled[:15].view(5, 3))
    assert torch.equal(buffer[:, 3:].t(), scaled[15:].view(5, 5))


def test_written_tensors_record_the_write():
    # Autograd's version counters: a saved tensor written in place afterwards must be detected.
    dsts, srcs, outs = [torch.zeros(3)], [torch.ones(3)], [torch.zeros(3)]
    versions = [t._version for t in dsts + srcs + outs]
    kernels.multi_tensor_accumulate_(dsts, srcs)
    kernels.unpack_(torch.ones(3), outs)
    assert dsts[0]._version > versions[0] and srcs[0]._version == versions[1] and outs[0]._version > versions[2]


def test_pack_unpack_round_trip():
    tensors = randn_list(FP32)
    outs = [torch.empty_like(t) for t in tensors]
    kernels.unpack_(kernels.pack(tensors, 0.5, FP32), outs, 2.0)
    for out, t in zip(outs, tensors):
        assert torch.equal(out, t)


# Autograd of the out-of-place ops.


def test_sum_n_backward_sends_the_gradient_to_every_input():
    tensors = [torch.randn(3, 4, requires_grad=True), torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)]
    grad = torch.randn(3, 4)
    kernels.sum_n(tensors).backward(grad)
    assert torch.equal(tensors[0].grad, grad) and torch.equal(tensors[2].grad, grad)
    assert tensors[1].grad is None


def test_pack_backward_unpacks_the_gradient():
    tensors = [torch.randn(2, 3).to(BF16).requires_grad_(), torch.randn(4), torch.randn(5, requires_grad=True)]
    grad_flat = torch.randn(15)
    kernels.pack(tensors, 0.5, FP32).backward(grad_flat)
    assert tensors[0].grad.dtype == BF16 and tensors[0].grad.shape == (2, 3)
    assert torch.equal(tensors[0].grad, (grad_flat[:6] * 0.5).to(BF16).view(2, 3))
    assert torch.equal(tensors[2].grad, grad_flat[10:] * 0.5)
    assert tensors[1].grad is None


# Errors: every implementation (CPU, CUDA, fake) checks arguments the same way.


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kernels.multi_tensor_accumulate_([torch.ones(2)], []), "got 1 dsts and 0 srcs"),
        (lambda: kernels.multi_tensor_accumulate_([torch.ones(2)], [torch.ones(3)]), r"dsts\[0\] has shape \(2,\)"),
        (lambda: kernels.multi_tensor_accumulate_([torch.ones(2)], [torch.ones(2).double()]), r"srcs\[0\] has dtype"),
        (lambda: kernels.multi_tensor_accumulate_([torch.ones(2)], [torch.ones(2, device="meta")]), r"srcs\[0\] is on"),
        (lambda: kernels.sum_n([]), "needs at least one tensor"),
        (lambda: kernels.sum_n([torch.ones(2), torch.ones(3)]), r"tensors\[1\] has shape \(3,\)"),
        (lambda: kernels.sum_n([torch.ones(2), torch.ones(2).half()]), r"tensors\[1\] has dtype torch.float16"),
        (lambda: kernels.sum_n([torch.ones(2, dtype=torch.int32)]), r"tensors\[0\] has dtype torch.int32"),
        (lambda: kernels.pack([torch.ones(2), torch.ones(2).half()]), r"tensors\[1\] .* pass dtype="),
        (lambda: kernels.pack([torch.ones(2)], dtype=torch.float64), "dtype torch.float64 is not supported"),
        (lambda: kernels.unpack_(torch.ones(2, 2), [torch.ones(4)]), "flat must be 1-D"),
        (
            lambda: kernels.unpack_(torch.ones(5), [torch.ones(2), torch.ones(2)]),
            "flat has 5 elements but the outs hold 4",
        ),
        (lambda: kernels.unpack_(torch.ones(2), [torch.ones(2).double()]), r"outs\[0\] has dtype"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# torch.compile decomposes the ops into their references (see torch_ext/kernels.py). The aot_eager backend
# runs all that concerns the ops (Dynamo with fullgraph, fake tensors, AOTAutograd's functionalization and
# the decomposition) without Inductor's C++ code generation, which took 28 s here with a cold cache.


def test_compile_fullgraph():
    def step(grads, accumulated, flat_out):
        kernels.multi_tensor_accumulate_(accumulated, grads, 0.5)
        flat = kernels.pack(grads, 2.0, BF16)
        kernels.unpack_(flat, flat_out, 0.25)
        return kernels.sum_n(grads[:2]), flat

    def make_args():
        torch.manual_seed(1)
        shapes = [(3, 5), (3, 5), (17,)]
        return randn_list(FP32, shapes), randn_list(FP32, shapes), [torch.empty(s) for s in shapes]

    eager_args, compiled_args = make_args(), make_args()
    eager_results = step(*eager_args)
    compiled_results = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_args)
    for eager, compiled in zip(
        eager_results + (*eager_args[1], *eager_args[2]), compiled_results + (*compiled_args[1], *compiled_args[2])
    ):
        assert torch.equal(eager, compiled)


# The switch, and importing without triton.


def test_set_triton_enabled_in_a_with_block_restores_the_setting():
    installed = kernels._multi_tensor_kernels() is not None
    with kernels.set_triton_enabled(True):
        assert kernels.is_triton_enabled() == installed
        with kernels.set_triton_enabled(False):
            assert not kernels.is_triton_enabled()
        assert kernels.is_triton_enabled() == installed


IMPORT_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if triton were not installed
import torch, torch_ext
flat = torch_ext.kernels.pack([torch.ones(2), torch.ones(3)], 2.0)
assert flat.tolist() == [2.0] * 5, flat
print(torch_ext.kernels.is_triton_enabled())
"""


@pytest.mark.slow
def test_import_and_ops_work_without_triton():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_TRITON], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert result.stderr == ""  # in particular no warning per op from triton_op's kernel search


# CUDA: the Triton kernels against the references on the same device.


def _on_both_paths(fn):
    """fn() with the Triton kernels, then with the references (args are made afresh inside fn)."""
    with kernels.set_triton_enabled(True):
        with_triton = fn()
    with kernels.set_triton_enabled(False):
        return with_triton, fn()


@cuda
@pytest.mark.parametrize("alpha", [1.0, -0.3])
@pytest.mark.parametrize("dst_dtype, src_dtype", [(FP32, FP32), (FP16, FP16), (BF16, BF16), (FP32, BF16)])
def test_cuda_accumulate_matches_reference(dst_dtype, src_dtype, alpha):
    def run():
        torch.manual_seed(0)
        dsts = randn_list(dst_dtype, device="cuda") + [torch.randn(8, 6, device="cuda").to(dst_dtype).t()]
        srcs = randn_list(src_dtype, device="cuda") + [torch.randn(6, 8, device="cuda").to(src_dtype)]
        kernels.multi_tensor_accumulate_(dsts, srcs, alpha)
        return dsts

    with_triton, reference = _on_both_paths(run)
    for actual, expected in zip(with_triton, reference):
        assert torch.equal(actual, expected)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_pack_unpack_sum_n_match_reference(dtype):
    def run():
        torch.manual_seed(0)
        tensors = randn_list(dtype, device="cuda") + [torch.randn(5, 3, device="cuda").to(dtype).t()]
        flat = kernels.pack(tensors, 0.5, BF16)
        outs = [torch.empty(t.shape, dtype=FP32, device="cuda") for t in tensors]
        kernels.unpack_(flat, outs, 3.0)
        return [flat, kernels.sum_n([tensors[0]] * 3), *outs]

    with_triton, reference = _on_both_paths(run)
    for actual, expected in zip(with_triton, reference):
        assert torch.equal(actual, expected)


@cuda
def test_cuda_accumulate_of_many_tensors_is_one_launch():
    dsts = [torch.zeros(i % 7 + 1, 33, device="cuda") for i in range(300)]
    srcs = [torch.ones_like(d) for d in dsts]
    kernels.multi_tensor_accumulate_(dsts, srcs)  # compiles the kernel outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        kernels.multi_tensor_accumulate_(dsts, srcs)
        torch.cuda.synchronize()
    launched = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_multi_tensor_scale_kernel" in name for name in launched) == 1, launched
    assert all(torch.equal(d, torch.full_like(d, 2.0)) for d in dsts)
