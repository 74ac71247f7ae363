// Fixture kernels for tests/test_cuda_elf.py; scripts/make-test-cubins rebuilds every artefact
// built from this file. Each parameter list is chosen so that its layout (ordinal, offset, size)
// follows by hand from the C ABI, and the tests compare that with what the cubin says.

struct Vec3 {            // 24 bytes, 8-byte aligned
    double x, y, z;
};

struct Big {             // 40 bytes, 8-byte aligned
    float *data;
    long long n;
    int shape[4];
    double scale;
};

// extern "C": an unmangled kernel name.
extern "C" __global__ void saxpy(float a, const float *x, float *y, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

// Templated: two instantiations, two mangled names.
template <typename T>
__global__ void fill(T *out, T value, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
template __global__ void fill<float>(float *, float, unsigned);
template __global__ void fill<double>(double *, double, unsigned);

// A struct passed by value.
__global__ void shift(Vec3 *points, Vec3 by, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        points[i].x += by.x;
        points[i].y += by.y;
        points[i].z += by.z;
    }
}

// Many parameters of many sizes: 1, 4, 8, 8 (pointer), 24, 40, 2, 8 (pointer) bytes.
__global__ void mixed(char c, int i, double d, float *p, Vec3 v, Big b, short s, char *q)
{
    if (threadIdx.x == 0) {
        b.data[0] = c + i + d + v.x + v.y + v.z + b.n + b.shape[3] + b.scale + s;
        p[0] = q[0];
    }
}

// A device function that is not a kernel: with -rdc it gets its own .text and .nv.info sections.
__device__ __noinline__ float helper(float v) { return v * 2.0f + 1.0f; }

__global__ void twice(float *v) { v[threadIdx.x] = helper(v[threadIdx.x]); }

// No parameters at all: no KPARAM_INFO and no CBANK_PARAM_SIZE in its .nv.info.
__global__ void noargs() {}
