"""Which buffers each kernel launch, copy and memset reads and writes, speculated from a trace.

The `access` record's fields are written once, as data, in gpuos_tools.stream.records (ACCESS).

A buffer is an allocation id (of an `alloc` record) and a byte range inside it. Granularity
`alloc` (default) gives the whole allocation; `range` gives, for a launch, the range from the
pointer to the end of its allocation (or as far as a size template says) and, for a copy or
memset, exactly the bytes it covers; `extent` is range where, for the kernels whose argument
structures it can read (PyTorch's elementwise, reduction and other ATen kernels, CuPy's
elementwise and random kernels, cuBLAS GEMMs, cuDNN convolutions, batch norm and layout
transforms, CUB reductions), each pointer gets the bytes those structures say it reaches.
Range and extent both take the direction those structures say (an output is written, an input
read) for the words of by-value parameters (structs, lambdas, untyped words), and leave out
the words they say are not pointers; a typed pointer keeps its prototype's direction at range.
Anything a decoder cannot check falls back to the prototype for that launch or pointer. A buffer that is both read and written is
listed in both. Several pointers
into one allocation give one entry per disjoint range (ranges that overlap or touch are merged;
at alloc granularity that is one entry per allocation).

`how` says how a buffer was found and why its direction: for a launch
`dptr:BASIS` (an argument word the driver confirmed as a device pointer) or `scan:BASIS`
(without `dptrs`: an 8-byte-aligned argument word that lies in a live allocation), where
BASIS is what the parameter's type says: `const` (`T const*`: read only), `pointer` (`T*`:
read and write), `struct` (passed by value: a struct, array or lambda, or any parameter
over 8 bytes of an extern "C" kernel; direction unknown, read and write assumed), `untyped`
(an 8-byte parameter of an extern "C" kernel, which has no prototype, or of a kernel whose
prototype does not match its launch: read and write assumed), `value` (a scalar by its type
whose word lies in a live allocation: read and write assumed), `reference`, and
`pointer-to-pointer`. A buffer found through memory is `stored`: a pointer held in device
memory that an argument points to, where that memory's contents are known because they were
copied from the host (`data` of a memcpy record; how batched GEMM's pointer arrays arrive):
read and write assumed. A buffer found through the launched kernel's module is
`variable:NAME`: a pointer the host copied into a `__device__` variable of the kernel's own
module, which the program located by name (`symbol` records): read and write assumed. At
range and extent granularity a decoded pointer's `how` is `dptr:DECODER` or
`scan:DECODER` (`pytorch`, `cupy`, `nvidia`; `template:DECODER` where a size template bounds it
at range); a word inside a decoded structure that the structure says is not a pointer (padding,
a size, an integer divider's constants) is not listed. For copies: `copy source`,
`copy destination`; for memsets: `memset`.

A launch is unknown when its layout is `none` (arguments not decoded), when a
driver-confirmed pointer lies in no traced allocation, or when a parameter is a pointer to
pointers whose memory's contents are not known (written on the GPU, or copied in pieces over
4096 bytes). A graph_launch reads and writes what the launches captured into its graph
(stream capture, `graph` records of the trace) do, predicted against the allocations live at
the graph launch, and says how many (`launches`); it is unknown when the graph was not built
by a stream capture the trace saw (memcpy and memset nodes captured into a graph are not
attributed to its launches). A kernel that
rewrites a pointer array on the GPU is not seen: the contents last copied from the host are
used (`gpu-trace run --validate` reports the pointers it finds in device memory). A copy or
memset is unknown when a device address in it lies in no traced allocation (nor in a module
variable the program located) or it runs past its allocation's end. Host addresses that are
not traced allocations are not listed; pinned host memory from `cuMemHostAlloc` is a traced
allocation (kind `host`) and is listed.

Directions come from prototypes (and, at range and extent granularity, from the decoded
structures), not from the kernels' code: `gpu-trace run --validate` checks them on the GPU.
"""

from gpuos_tools.access.predict import GRANULARITIES, Finding, KernelInfo, Predictor, kernel_info
from gpuos_tools.access.proto import classify, prototype, split_params

__all__ = [
    "GRANULARITIES",
    "Finding",
    "KernelInfo",
    "Predictor",
    "classify",
    "kernel_info",
    "prototype",
    "split_params",
]
