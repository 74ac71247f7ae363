"""Prototype parsing and classification, on demangled names taken from the recorded traces."""

from __future__ import annotations

import pytest

from gpuos_tools.access.proto import classify, prototype, split_params
from gpuos_tools.cuda.elf import demangle

# torch.ndjson.zst, seq 14
SOFTMAX_BWD = ("_ZN43_GLOBAL__N__b6de9c8c_10_SoftMax_cu_9f978f6321softmax_warp_backwardIfffLi4ELb1ELb0EEEvPT0_PKT_"
               "S5_iiiPKb")  # fmt: skip
# apis.ndjson.zst, seq 10: a lambda with its own parameter list inside a template argument
REDUCE = (
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4, 4>)"
)
# torch.ndjson.zst, seq 5: (anonymous namespace), a function's parameter list and lambdas
CLAMP = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar("
    "at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#1}::operator()() "
    "const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::(anonymous "
    "namespace)::launch_clamp_scalar(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)"
    "::{lambda()#1}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)"
)
# torch.ndjson.zst, seq 4
SPLITK = (
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, float, float, float, true, true, "
    "false, false>(cublasLt::cublasSplitKParams<float>, float const*, float const*, float*, float*, float const*, "
    "float const*, float const*, float const*, float*, void*, long, float*, int*, float*, float*, float const*, "
    "float const*, float const*, float const*, float const*)"
)


def test_softmax_backward_from_its_mangled_name() -> None:
    name = demangle(SOFTMAX_BWD)
    assert name.endswith("(float*, float const*, float const*, int, int, int, bool const*)")
    assert prototype(name) == (
        ("float*", "pointer"), ("float const*", "const"), ("float const*", "const"),
        ("int", "value"), ("int", "value"), ("int", "value"), ("bool const*", "const"),
    )  # fmt: skip


def test_lambda_parameter_lists_do_not_split_the_prototype() -> None:
    params = split_params(REDUCE)
    assert params is not None and len(params) == 1
    assert params[0].startswith("at::native::ReduceOp<float,") and params[0].endswith("4, 4>")
    assert classify(params[0]) == "struct"


def test_anonymous_namespace_and_nested_functions() -> None:
    params = split_params(CLAMP)
    assert params is not None
    assert [classify(p) for p in params] == ["value", "struct", "struct"]
    assert params[0] == "int" and params[2] == "std::array<char*, 2ul>"
    assert params[1].endswith("{lambda(float)#1}")


def test_cublaslt_splitk() -> None:
    bases = [b for _, b in prototype(SPLITK)]
    assert len(bases) == 21
    assert bases[0] == "struct" and bases[1] == bases[2] == "const" and bases[3] == "pointer"
    assert bases[10] == "pointer"  # void*
    assert bases[11] == "value"  # long


@pytest.mark.parametrize(
    ("text", "basis"),
    [
        ("float const*", "const"), ("const float*", "const"), ("float const* __restrict__", "const"),
        ("float* const", "pointer"), ("void*", "pointer"), ("float**", "pointer-to-pointer"),
        ("float const* const*", "pointer-to-pointer"), ("unsigned long", "value"), ("bool", "value"),
        ("void (*)(int)", "value"), ("cublasLtEpilogue_t", "struct"), ("int&", "reference"),
        ("at::native::FillFunctor<float>", "struct"),
    ],
)  # fmt: skip
def test_classify(text: str, basis: str) -> None:
    assert classify(text) == basis


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("f()", []), ("f(void)", []), ("cupy_fill", None), ("f(int, float*)", ["int", "float*"]),
        ("bool operator<(A, B)", ["A", "B"]), ("void g<&operator<<, 1>(int)", ["int"]),
        ("void k<std::less<int> >(std::pair<int, int>, int)", ["std::pair<int, int>", "int"]),
    ],
)  # fmt: skip
def test_split_params(name: str, params: list[str] | None) -> None:
    assert split_params(name) == params
