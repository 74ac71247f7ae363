/*
 * gpuos_intercept: driver-API interception without CUPTI (counts calls; the agent's front end
 * when built with -DGPUOS_AGENT).
 *
 * Why: the driver checkpoint API refuses a process that has CUPTI loaded, so an agent built on
 * CUPTI callbacks makes its program impossible to checkpoint with `gpu-ckpt --pid` or CRIU. This
 * library sees the same driver calls by standing between the program and libcuda instead, and
 * only counts them: each kind of call by the route it was reached through, and each kernel (per
 * CUfunction handle) it launched. docs/interception.md says what it is measured against.
 *
 * How a program reaches a driver function, and how each route is caught (LD_PRELOAD=this):
 *   direct   the program (or a library) links libcuda and calls cuLaunchKernel: the dynamic
 *            linker binds the call to the first definition in the global scope, which is ours
 *            (preloaded objects come before libcuda).
 *   dlsym    dlopen("libcuda.so.1") + dlsym(handle, "cuLaunchKernel") (ctypes, Triton's launcher,
 *            the CUDA runtime for cuGetProcAddress itself): a lookup in a handle's own scope skips
 *            preloaded objects, so dlsym itself is interposed; when the answer is libcuda's own
 *            function for a name we wrap, a wrapper is returned instead.
 *   getproc  cuGetProcAddress / cuGetProcAddress_v2 (the CUDA runtime, PyTorch, cuBLAS, cuDNN get
 *            every entry point this way): the real call runs, and the pointer it hands out is
 *            replaced by a wrapper when it is one of ours.
 * A wrapper handed out for a pointer is one of NSLOT copies per kind of call, each bound to one
 * real pointer (legacy or per-thread-stream variant, route), so forwarding keeps the variant the
 * caller asked for. A pointer is recognised by identity with libcuda's exported symbol of that
 * name; when the driver hands out another address for a name we wrap, the newest signature we
 * know for the requested version is used (counted as by_name), and never past CUDA 13.x.
 *
 * dlsym(RTLD_NEXT) and dlsym(RTLD_DEFAULT) depend on who calls: they are forwarded by a tail
 * call, so that libc sees the original caller's return address (tests/test_intercept.py checks
 * both). Not caught: dlvsym, calls through the driver's private tables (cuGetExportTable is
 * counted, not what is called through its answer), kernels inside CUDA graphs (the graph launch
 * is counted).
 *
 * Environment: GPUOS_INTERCEPT_OUT=PATH (at exit, the counts as JSON; %p becomes the pid;
 * nothing is written by a process that made no intercepted call), GPUOS_INTERCEPT_LIBCUDA=PATH
 * (the driver library; default libcuda.so.1), GPUOS_INTERCEPT_NAMES=0 (do not resolve kernel
 * names). No CUDA header is needed: the few types used are declared below.
 *
 * Build: cc -O2 -shared -fPIC -o libgpuos_intercept.so gpuos_intercept.c -ldl -lpthread
 *
 * Built with -DGPUOS_AGENT and linked with gpuos_record.c and gpuos_core.c (injection/intercept.py
 * build_agent), it is also the agent's front end without CUPTI: from gpuos_intercept_start on,
 * every wrapped call is recorded and handed to the native core at its enter and exit as the CUPTI
 * callback does (the section "the agent's front end" below says how).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the driver's types (cuda.h), only as far as they are passed through */
typedef int CUresult;
typedef void *CUfunction, *CUstream, *CUevent, *CUgraph, *CUgraphExec, *CUmemoryPool, *CUmodule,
    *CUlibrary, *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
#define CUDA_ERROR_NOT_FOUND 500
#define NOKERNEL ((void *)0)

enum { ROUTE_DIRECT, ROUTE_DLSYM, ROUTE_GETPROC, NROUTES };
static const char *const route_names[NROUTES] = {"direct", "dlsym", "getproc"};

/*
 * Every kind of call wrapped: X(id, exported name, base name for cuGetProcAddress, CUDA version
 * that introduced this signature, parameters, arguments, the CUfunction launched or NOKERNEL).
 * Each is also exported with the _ptsz and _ptds suffixes (the per-thread default stream
 * variants, same signature); a suffix the driver does not have is never called.
 */
#define CALLS(X)                                                                                   \
    X(LAUNCH, cuLaunchKernel, "cuLaunchKernel", 4000,                                              \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,  \
       unsigned smem, CUstream s, void **kp, void **ex),                                           \
      (f, gx, gy, gz, bx, by, bz, smem, s, kp, ex), f)                                             \
    X(LAUNCH_EX, cuLaunchKernelEx, "cuLaunchKernelEx", 11060,                                      \
      (const void *cfg, CUfunction f, void **kp, void **ex), (cfg, f, kp, ex), f)                  \
    X(LAUNCH_COOP, cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000,                   \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,  \
       unsigned smem, CUstream s, void **kp),                                                      \
      (f, gx, gy, gz, bx, by, bz, smem, s, kp), f)                                                 \
    X(GRAPH_LAUNCH, cuGraphLaunch, "cuGraphLaunch", 10000, (CUgraphExec g, CUstream s), (g, s),    \
      NOKERNEL)                                                                                    \
    X(ALLOC, cuMemAlloc_v2, "cuMemAlloc", 3020, (CUdeviceptr * p, size_t n), (p, n), NOKERNEL)     \
    X(ALLOC_PITCH, cuMemAllocPitch_v2, "cuMemAllocPitch", 3020,                                    \
      (CUdeviceptr * p, size_t * pitch, size_t w, size_t h, unsigned e), (p, pitch, w, h, e),      \
      NOKERNEL)                                                                                    \
    X(ALLOC_MANAGED, cuMemAllocManaged, "cuMemAllocManaged", 6000,                                 \
      (CUdeviceptr * p, size_t n, unsigned fl), (p, n, fl), NOKERNEL)                              \
    X(ALLOC_ASYNC, cuMemAllocAsync, "cuMemAllocAsync", 11020, (CUdeviceptr * p, size_t n, CUstream s),\
      (p, n, s), NOKERNEL)                                                                         \
    X(ALLOC_POOL, cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020,                       \
      (CUdeviceptr * p, size_t n, CUmemoryPool pool, CUstream s), (p, n, pool, s), NOKERNEL)       \
    X(ALLOC_HOST, cuMemAllocHost_v2, "cuMemAllocHost", 3020, (void **p, size_t n), (p, n), NOKERNEL)\
    X(HOST_ALLOC, cuMemHostAlloc, "cuMemHostAlloc", 2020, (void **p, size_t n, unsigned fl),       \
      (p, n, fl), NOKERNEL)                                                                        \
    X(FREE, cuMemFree_v2, "cuMemFree", 3020, (CUdeviceptr p), (p), NOKERNEL)                       \
    X(FREE_ASYNC, cuMemFreeAsync, "cuMemFreeAsync", 11020, (CUdeviceptr p, CUstream s), (p, s),    \
      NOKERNEL)                                                                                    \
    X(FREE_HOST, cuMemFreeHost, "cuMemFreeHost", 2000, (void *p), (p), NOKERNEL)                   \
    X(MEM_CREATE, cuMemCreate, "cuMemCreate", 10020,                                               \
      (CUmemGenericAllocationHandle * h, size_t n, const void *prop, unsigned long long fl),       \
      (h, n, prop, fl), NOKERNEL)                                                                  \
    X(MEM_RELEASE, cuMemRelease, "cuMemRelease", 10020, (CUmemGenericAllocationHandle h), (h),     \
      NOKERNEL)                                                                                    \
    X(MEM_MAP, cuMemMap, "cuMemMap", 10020,                                                        \
      (CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h, unsigned long long fl), \
      (p, n, off, h, fl), NOKERNEL)                                                                \
    X(MEM_UNMAP, cuMemUnmap, "cuMemUnmap", 10020, (CUdeviceptr p, size_t n), (p, n), NOKERNEL)     \
    X(COPY, cuMemcpy, "cuMemcpy", 4000, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n),       \
      NOKERNEL)                                                                                    \
    X(COPY_ASYNC, cuMemcpyAsync, "cuMemcpyAsync", 4000,                                            \
      (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st), NOKERNEL)              \
    X(COPY_HTOD, cuMemcpyHtoD_v2, "cuMemcpyHtoD", 3020, (CUdeviceptr d, const void *s, size_t n),  \
      (d, s, n), NOKERNEL)                                                                         \
    X(COPY_DTOH, cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, (void *d, CUdeviceptr s, size_t n),        \
      (d, s, n), NOKERNEL)                                                                         \
    X(COPY_DTOD, cuMemcpyDtoD_v2, "cuMemcpyDtoD", 3020, (CUdeviceptr d, CUdeviceptr s, size_t n),  \
      (d, s, n), NOKERNEL)                                                                         \
    X(COPY_HTOD_ASYNC, cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", 3020,                            \
      (CUdeviceptr d, const void *s, size_t n, CUstream st), (d, s, n, st), NOKERNEL)              \
    X(COPY_DTOH_ASYNC, cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", 3020,                            \
      (void *d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st), NOKERNEL)                    \
    X(COPY_DTOD_ASYNC, cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", 3020,                            \
      (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st), NOKERNEL)              \
    X(COPY_PEER, cuMemcpyPeer, "cuMemcpyPeer", 4000,                                               \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n),     \
      NOKERNEL)                                                                                    \
    X(COPY_PEER_ASYNC, cuMemcpyPeerAsync, "cuMemcpyPeerAsync", 4000,                               \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),           \
      (d, dc, s, sc, n, st), NOKERNEL)                                                             \
    X(COPY_2D, cuMemcpy2D_v2, "cuMemcpy2D", 3020, (const void *c), (c), NOKERNEL)                  \
    X(COPY_2D_UNALIGNED, cuMemcpy2DUnaligned_v2, "cuMemcpy2DUnaligned", 3020, (const void *c), (c),\
      NOKERNEL)                                                                                    \
    X(COPY_2D_ASYNC, cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", 3020, (const void *c, CUstream st),    \
      (c, st), NOKERNEL)                                                                           \
    X(COPY_3D, cuMemcpy3D_v2, "cuMemcpy3D", 3020, (const void *c), (c), NOKERNEL)                  \
    X(COPY_3D_ASYNC, cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", 3020, (const void *c, CUstream st),    \
      (c, st), NOKERNEL)                                                                           \
    X(SET_D8, cuMemsetD8_v2, "cuMemsetD8", 3020, (CUdeviceptr d, unsigned char v, size_t n),       \
      (d, v, n), NOKERNEL)                                                                         \
    X(SET_D16, cuMemsetD16_v2, "cuMemsetD16", 3020, (CUdeviceptr d, unsigned short v, size_t n),   \
      (d, v, n), NOKERNEL)                                                                         \
    X(SET_D32, cuMemsetD32_v2, "cuMemsetD32", 3020, (CUdeviceptr d, unsigned v, size_t n),         \
      (d, v, n), NOKERNEL)                                                                         \
    X(SET_D8_ASYNC, cuMemsetD8Async, "cuMemsetD8Async", 3020,                                      \
      (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st), NOKERNEL)            \
    X(SET_D16_ASYNC, cuMemsetD16Async, "cuMemsetD16Async", 3020,                                   \
      (CUdeviceptr d, unsigned short v, size_t n, CUstream st), (d, v, n, st), NOKERNEL)           \
    X(SET_D32_ASYNC, cuMemsetD32Async, "cuMemsetD32Async", 3020,                                   \
      (CUdeviceptr d, unsigned v, size_t n, CUstream st), (d, v, n, st), NOKERNEL)                 \
    X(SET_2D8, cuMemsetD2D8_v2, "cuMemsetD2D8", 3020,                                              \
      (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h), (d, pitch, v, w, h),     \
      NOKERNEL)                                                                                    \
    X(SET_2D16, cuMemsetD2D16_v2, "cuMemsetD2D16", 3020,                                           \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h), (d, pitch, v, w, h),    \
      NOKERNEL)                                                                                    \
    X(SET_2D32, cuMemsetD2D32_v2, "cuMemsetD2D32", 3020,                                           \
      (CUdeviceptr d, size_t pitch, unsigned v, size_t w, size_t h), (d, pitch, v, w, h), NOKERNEL)\
    X(SET_2D8_ASYNC, cuMemsetD2D8Async, "cuMemsetD2D8Async", 3020,                                 \
      (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h, CUstream st),             \
      (d, pitch, v, w, h, st), NOKERNEL)                                                           \
    X(SET_2D16_ASYNC, cuMemsetD2D16Async, "cuMemsetD2D16Async", 3020,                              \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h, CUstream st),            \
      (d, pitch, v, w, h, st), NOKERNEL)                                                           \
    X(SET_2D32_ASYNC, cuMemsetD2D32Async, "cuMemsetD2D32Async", 3020,                              \
      (CUdeviceptr d, size_t pitch, unsigned v, size_t w, size_t h, CUstream st),                  \
      (d, pitch, v, w, h, st), NOKERNEL)                                                           \
    X(STREAM_CREATE, cuStreamCreate, "cuStreamCreate", 2000, (CUstream * s, unsigned fl), (s, fl), \
      NOKERNEL)                                                                                    \
    X(STREAM_CREATE_PRIO, cuStreamCreateWithPriority, "cuStreamCreateWithPriority", 5050,          \
      (CUstream * s, unsigned fl, int prio), (s, fl, prio), NOKERNEL)                              \
    X(STREAM_DESTROY, cuStreamDestroy_v2, "cuStreamDestroy", 4000, (CUstream s), (s), NOKERNEL)    \
    X(STREAM_SYNC, cuStreamSynchronize, "cuStreamSynchronize", 2000, (CUstream s), (s), NOKERNEL)  \
    X(STREAM_WAIT_EVENT, cuStreamWaitEvent, "cuStreamWaitEvent", 3020,                             \
      (CUstream s, CUevent e, unsigned fl), (s, e, fl), NOKERNEL)                                  \
    X(EVENT_RECORD, cuEventRecord, "cuEventRecord", 2000, (CUevent e, CUstream s), (e, s), NOKERNEL)\
    X(EVENT_RECORD_FLAGS, cuEventRecordWithFlags, "cuEventRecordWithFlags", 11010,                 \
      (CUevent e, CUstream s, unsigned fl), (e, s, fl), NOKERNEL)                                  \
    X(EVENT_SYNC, cuEventSynchronize, "cuEventSynchronize", 2000, (CUevent e), (e), NOKERNEL)      \
    X(CAPTURE_BEGIN, cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, (CUstream s, int mode),\
      (s, mode), NOKERNEL)                                                                         \
    X(CAPTURE_BEGIN_V1, cuStreamBeginCapture, "cuStreamBeginCapture", 10000, (CUstream s), (s),      \
      NOKERNEL)                                                                                    \
    X(CAPTURE_BEGIN_TO_GRAPH, cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", 12030,   \
      (CUstream s, CUgraph g, const void *deps, const void *data, size_t n, int mode),             \
      (s, g, deps, data, n, mode), NOKERNEL)                                                       \
    X(CAPTURE_END, cuStreamEndCapture, "cuStreamEndCapture", 10000, (CUstream s, CUgraph * g),     \
      (s, g), NOKERNEL)                                                                            \
    X(INSTANTIATE_V2, cuGraphInstantiate_v2, "cuGraphInstantiate", 11000,                          \
      (CUgraphExec * e, CUgraph g, void *err_node, char *log, size_t log_size),                    \
      (e, g, err_node, log, log_size), NOKERNEL)                                                   \
    X(INSTANTIATE_PARAMS, cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000,     \
      (CUgraphExec * e, CUgraph g, void *params), (e, g, params), NOKERNEL)                        \
    X(INSTANTIATE, cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 11040,              \
      (CUgraphExec * e, CUgraph g, unsigned long long fl), (e, g, fl), NOKERNEL)                   \
    X(MODULE_LOAD, cuModuleLoadData, "cuModuleLoadData", 2000, (CUmodule * m, const void *img),    \
      (m, img), NOKERNEL)                                                                          \
    X(MODULE_LOAD_EX, cuModuleLoadDataEx, "cuModuleLoadDataEx", 2010,                              \
      (CUmodule * m, const void *img, unsigned n, void *o, void **v), (m, img, n, o, v), NOKERNEL) \
    X(LIBRARY_LOAD, cuLibraryLoadData, "cuLibraryLoadData", 12000,                                 \
      (CUlibrary * l, const void *code, void *jo, void **jv, unsigned nj, void *lo, void **lv,      \
       unsigned nl),                                                                               \
      (l, code, jo, jv, nj, lo, lv, nl), NOKERNEL)                                                \
    X(MODULE_LOAD_FATBIN, cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 2000,                    \
      (CUmodule * m, const void *img), (m, img), NOKERNEL)                                         \
    X(MODULE_UNLOAD, cuModuleUnload, "cuModuleUnload", 2000, (CUmodule m), (m), NOKERNEL)          \
    X(LIBRARY_UNLOAD, cuLibraryUnload, "cuLibraryUnload", 12000, (CUlibrary l), (l), NOKERNEL)     \
    X(MODULE_GET_GLOBAL, cuModuleGetGlobal_v2, "cuModuleGetGlobal", 3020,                         \
      (CUdeviceptr * p, size_t * n, CUmodule m, const char *name), (p, n, m, name), NOKERNEL)      \
    X(MODULE_GET_FUNCTION, cuModuleGetFunction, "cuModuleGetFunction", 2000,                       \
      (CUfunction * f, CUmodule m, const char *name), (f, m, name), NOKERNEL)                      \
    X(LIBRARY_GET_GLOBAL, cuLibraryGetGlobal, "cuLibraryGetGlobal", 12000,                         \
      (CUdeviceptr * p, size_t * n, CUlibrary l, const char *name), (p, n, l, name), NOKERNEL)     \
    X(LIBRARY_GET_KERNEL, cuLibraryGetKernel, "cuLibraryGetKernel", 12000,                         \
      (void **k, CUlibrary l, const char *name), (k, l, name), NOKERNEL)                           \
    X(EXPORT_TABLE, cuGetExportTable, "cuGetExportTable", 3000, (const void **t, const void *id),  \
      (t, id), NOKERNEL)                                                                           \
    X(INIT, cuInit, "cuInit", 2000, (unsigned fl), (fl), NOKERNEL)

/* the two signatures of cuGetProcAddress: wrapped too, their answers rewritten */
#define GETPROCS(X)                                                                                \
    X(GETPROC, cuGetProcAddress, "cuGetProcAddress", 11030,                                        \
      (const char *sym, void **pfn, int ver, cuuint64_t fl), (sym, pfn, ver, fl), NOKERNEL)        \
    X(GETPROC_V2, cuGetProcAddress_v2, "cuGetProcAddress", 12000,                                  \
      (const char *sym, void **pfn, int ver, cuuint64_t fl, int *st), (sym, pfn, ver, fl, st),      \
      NOKERNEL)

#define ENUM_ID(id, name, base, since, P, A, K) F_##id,
enum { CALLS(ENUM_ID) GETPROCS(ENUM_ID) NCALLS };
#define NAME_OF(id, name, base, since, P, A, K) #name,
static const char *const call_names[NCALLS] = {CALLS(NAME_OF) GETPROCS(NAME_OF)};
#define TYPEDEF(id, name, base, since, P, A, K) typedef CUresult(*id##_t) P;
CALLS(TYPEDEF)
GETPROCS(TYPEDEF)

/* ---- the names we answer for: each call kind under its three exported names */
#define NVARIANTS 3
typedef struct { const char *name, *base; int call, since; } entry_t;
#define ENTRIES(id, name, base, since, P, A, K)                                                    \
    {#name, base, F_##id, since}, {#name "_ptsz", base, F_##id, since},                            \
        {#name "_ptds", base, F_##id, since},
static const entry_t entries[] = {CALLS(ENTRIES) GETPROCS(ENTRIES)};
#define NENTRIES ((int)(sizeof entries / sizeof entries[0]))
#define ABSENT ((void *)1)
static void *entry_real[NENTRIES]; /* libcuda's address of each name; ABSENT if it has none */
#define MAX_GUESSED_VERSION 13999 /* the newest CUDA whose signatures this table knows */

/* ---- counters */
static uint64_t calls[NCALLS][NROUTES];
static uint64_t n_getproc_identity, n_getproc_by_name, n_getproc_other, n_dlsym_wrapped,
    n_slots_full, n_kernels_dropped;
#define MAX_SKIPPED 32
static uint8_t requested[NCALLS]; /* kinds of call some cuGetProcAddress asked for */
static char *skipped[MAX_SKIPPED]; /* names of ours whose handed-out pointer we could not wrap */
static int skipped_version[MAX_SKIPPED], n_skipped;

#define KCAP 32768 /* distinct kernels remembered (power of two) */
typedef struct { void *func; uint64_t launches; char *name; } kernel_t;
static kernel_t kernels[KCAP];
static int want_names = 1;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void *(*real_dlsym)(void *, const char *);
static void *cuda_handle;
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT, cuda_once = PTHREAD_ONCE_INIT;

static void find_real_dlsym(void) {
    /* dlsym moved from libdl into libc in glibc 2.34; older ones have only the first version */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !real_dlsym; i++)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

static inline void *(*get_real_dlsym(void))(void *, const char *) {
    if (__builtin_expect(!real_dlsym, 0)) pthread_once(&dlsym_once, find_real_dlsym);
    return real_dlsym;
}

static __thread int opening_cuda; /* loading libcuda may run code that asks us again */

static void open_cuda(void) {
    opening_cuda = 1;
    const char *path = getenv("GPUOS_INTERCEPT_LIBCUDA");
    if (!path || !*path) path = "libcuda.so.1";
    /* the one the program loaded, matched by soname, else load it */
    cuda_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!cuda_handle) cuda_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    opening_cuda = 0;
}

static void *cuda(void) {
    if (__builtin_expect(!cuda_handle, 0)) {
        if (opening_cuda) return NULL;
        pthread_once(&cuda_once, open_cuda);
    }
    return cuda_handle;
}

/* libcuda's own address for entries[i], or NULL */
static void *entry_get(int i) {
    void *r = __atomic_load_n(&entry_real[i], __ATOMIC_ACQUIRE);
    if (__builtin_expect(!r, 0)) {
        void *h = cuda();
        void *(*dl)(void *, const char *) = get_real_dlsym();
        if (!h || !dl) return NULL; /* no driver (yet): ask again next time */
        r = dl(h, entries[i].name);
        if (!r) r = ABSENT;
        __atomic_store_n(&entry_real[i], r, __ATOMIC_RELEASE);
    }
    return r == ABSENT ? NULL : r;
}

/* ---- kernels, by CUfunction (a CUkernel passed as one counts as its own) */
typedef CUresult (*name_of_t)(const char **, void *);
static name_of_t p_func_name, p_kernel_name;
static pthread_once_t names_once = PTHREAD_ONCE_INIT;

static void find_name_getters(void) {
    void *h = cuda();
    void *(*dl)(void *, const char *) = get_real_dlsym();
    if (!h || !dl) return;
    p_func_name = (name_of_t)dl(h, "cuFuncGetName");
    p_kernel_name = (name_of_t)dl(h, "cuKernelGetName");
}

static char *kernel_name(void *f) {
    if (!want_names) return NULL;
    pthread_once(&names_once, find_name_getters);
    const char *name = NULL;
    if (!(p_func_name && p_func_name(&name, f) == 0 && name))
        if (!(p_kernel_name && p_kernel_name(&name, f) == 0 && name)) return NULL;
    return strdup(name);
}

static void note_kernel(void *f) {
    size_t h = ((uintptr_t)f >> 4) * 0x9E3779B97F4A7C15ull >> 49; /* 15 bits */
    for (size_t probe = 0; probe < KCAP; probe++) {
        kernel_t *k = &kernels[(h + probe) & (KCAP - 1)];
        void *seen = __atomic_load_n(&k->func, __ATOMIC_ACQUIRE);
        if (seen == f) {
            __atomic_fetch_add(&k->launches, 1, __ATOMIC_RELAXED);
            return;
        }
        if (!seen) {
            void *expected = NULL;
            if (__atomic_compare_exchange_n(&k->func, &expected, f, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                __atomic_store_n(&k->name, kernel_name(f), __ATOMIC_RELEASE);
                __atomic_fetch_add(&k->launches, 1, __ATOMIC_RELAXED);
                return;
            }
            if (expected == f) {
                __atomic_fetch_add(&k->launches, 1, __ATOMIC_RELAXED);
                return;
            }
        }
    }
    __atomic_fetch_add(&n_kernels_dropped, 1, __ATOMIC_RELAXED);
}

static inline void bump(int call, int route) {
    __atomic_fetch_add(&calls[call][route], 1, __ATOMIC_RELAXED);
}

/* ---- the agent's front end (built with -DGPUOS_AGENT, linked with gpuos_record.c and gpuos_core.c)
 *
 * Every wrapped call goes to the recorder at its enter and its exit, as the CUPTI callback's
 * driver-API site does (gpuos_record.h): its arguments are laid out as CUPTI's parameter struct
 * of the call (one 8-byte field per argument, the launch dimensions packed as 32-bit fields), its
 * id is its entry's index (F_x * NVARIANTS + variant: the names the HELLO frame carries). What
 * CUPTI's resource callbacks report comes from the calls themselves: a module loaded (the image
 * handed to the load call), a module or library about to be unloaded, a stream created or
 * destroyed. A driver call made while the agent is working in this thread (its upcalls into
 * Python) is the agent's own and is forwarded untouched; so are calls before
 * gpuos_intercept_start and after gpuos_intercept_stop.
 */
#ifdef GPUOS_AGENT
#include "gpuos_record.h"

#define U64(a) ((uint64_t)(uintptr_t)(a))
#define EXPAND(...) __VA_ARGS__
#define NARGS(...) NARGS_(__VA_ARGS__, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define NARGS_(a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, n, ...) n
#define CAT(a, b) CAT_(a, b)
#define CAT_(a, b) a##b
#define PACK_1(q, i, a) q[i] = U64(a);
#define PACK_2(q, i, a, ...) q[i] = U64(a); PACK_1(q, i + 1, __VA_ARGS__)
#define PACK_3(q, i, a, ...) q[i] = U64(a); PACK_2(q, i + 1, __VA_ARGS__)
#define PACK_4(q, i, a, ...) q[i] = U64(a); PACK_3(q, i + 1, __VA_ARGS__)
#define PACK_5(q, i, a, ...) q[i] = U64(a); PACK_4(q, i + 1, __VA_ARGS__)
#define PACK_6(q, i, a, ...) q[i] = U64(a); PACK_5(q, i + 1, __VA_ARGS__)
#define PACK_7(q, i, a, ...) q[i] = U64(a); PACK_6(q, i + 1, __VA_ARGS__)
#define PACK_8(q, i, a, ...) q[i] = U64(a); PACK_7(q, i + 1, __VA_ARGS__)
#define PACK_9(q, i, a, ...) q[i] = U64(a); PACK_8(q, i + 1, __VA_ARGS__)
#define PACK_10(q, i, a, ...) q[i] = U64(a); PACK_9(q, i + 1, __VA_ARGS__)
#define PACK_11(q, i, a, ...) q[i] = U64(a); PACK_10(q, i + 1, __VA_ARGS__)
#define PACK_(q, ...) CAT(PACK_, NARGS(__VA_ARGS__))(q, 0, __VA_ARGS__)
#define PACK(q, A) PACK_(q, EXPAND A)

static int agent_on;             /* between gpuos_intercept_start and _stop */
static __thread int in_agent;    /* this thread is inside the recorder or the agent */
static uint64_t next_module_id;  /* CUPTI numbers modules; so do we */

/* CUPTI's parameter struct of the call from one field per argument (q). Only the launches
   differ: cuLaunchKernel_params and cuLaunchCooperativeKernel_params pack their seven 32-bit
   dimensions after the function (f, 7 x u32, pad, stream, kernelParams[, extra]). */
static const void *cupti_params(int call, const uint64_t *q, uint64_t *out) {
    if (call != F_LAUNCH && call != F_LAUNCH_COOP) return q;
    uint32_t dims[7];
    for (int i = 0; i < 7; i++) dims[i] = (uint32_t)q[1 + i];
    memset(out, 0, 8 * 8);
    out[0] = q[0];
    memcpy(out + 1, dims, sizeof dims);
    out[5] = q[8];
    out[6] = q[9];
    out[7] = call == F_LAUNCH ? q[10] : 0;
    return out;
}

static void agent_before(int call, uint32_t cbid, const uint64_t *q) {
    in_agent++;
    if (call == F_MODULE_UNLOAD || call == F_LIBRARY_UNLOAD) rec_module_unloading();
    else if (call == F_STREAM_DESTROY) rec_stream(q[0], 1);
    else if (rec_kind(cbid)) {
        uint64_t packed[8];
        rec_call(cbid, REC_ENTER, cupti_params(call, q, packed), 0, 0, NULL);
    }
    in_agent--;
}

static void agent_after(int call, uint32_t cbid, const uint64_t *q, CUresult rc) {
    in_agent++;
    if (rc == 0 && (call == F_MODULE_LOAD || call == F_MODULE_LOAD_EX || call == F_LIBRARY_LOAD ||
                    call == F_MODULE_LOAD_FATBIN)) {
        const unsigned char *img = (const unsigned char *)(uintptr_t)q[1];
        uint64_t size = img ? rec_image_size(&img) : 0;
        rec_module_loaded(__atomic_add_fetch(&next_module_id, 1, __ATOMIC_RELAXED), img, size);
    } else if (rc == 0 && (call == F_STREAM_CREATE || call == F_STREAM_CREATE_PRIO) && q[0]) {
        rec_stream(*(const uint64_t *)(uintptr_t)q[0], 0);
    }
    if (rec_kind(cbid)) {
        uint64_t packed[8];
        rec_call(cbid, REC_EXIT, cupti_params(call, q, packed), (uint32_t)rc, 0, NULL);
    }
    in_agent--;
}

#define AGENT_CALL(id, r, A, variant)                                                              \
    if (__atomic_load_n(&agent_on, __ATOMIC_RELAXED) && !in_agent) {                               \
        uint64_t q_[11] = {0};                                                                     \
        PACK(q_, A)                                                                                \
        uint32_t cbid_ = (uint32_t)(F_##id * NVARIANTS + (variant));                               \
        agent_before(F_##id, cbid_, q_);                                                           \
        CUresult rc_ = ((id##_t)(r))A;                                                             \
        agent_after(F_##id, cbid_, q_, rc_);                                                       \
        return rc_;                                                                                \
    }
#else
#define AGENT_CALL(id, r, A, variant)
#endif

/* ---- before the driver starts: gpuos_intercept_before_init(fn) has fn called once, in the
 * first cuInit after it, before the real one runs (the program's libraries are loaded and its
 * driver has no state yet: a process forked there can still start its own driver, with the
 * program's address-space layout; the out-of-process validator's zygote, agent/zygote.py). */
static void (*init_hook)(void);

void gpuos_intercept_before_init(void (*fn)(void)) { __atomic_store_n(&init_hook, fn, __ATOMIC_RELEASE); }

static void before_init(void) {
    void (*fn)(void) = __atomic_exchange_n(&init_hook, (void (*)(void))0, __ATOMIC_ACQ_REL);
    if (fn) fn();
}

/* ---- wrappers handed out (dlsym, cuGetProcAddress): NSLOT per call kind, one real pointer each */
#define NSLOT 8
typedef struct { void *real; int route, variant; } slot_t;
static slot_t slots[NCALLS][NSLOT];
static int slots_used[NCALLS];

#define BODY(id, realexpr, route, A, K, variant)                                                   \
    {                                                                                              \
        void *k_ = (void *)(K);                                                                    \
        if (k_) note_kernel(k_);                                                                   \
        bump(F_##id, route);                                                                       \
        if (F_##id == F_INIT) before_init();                                                       \
        void *r_ = (realexpr);                                                                     \
        if (__builtin_expect(!r_, 0)) return CUDA_ERROR_NOT_FOUND;                                 \
        AGENT_CALL(id, r_, A, variant)                                                             \
        return ((id##_t)r_) A;                                                                     \
    }
#define SLOT(id, P, A, K, n)                                                                       \
    static CUresult id##_slot##n P BODY(id, slots[F_##id][n].real, slots[F_##id][n].route, A, K,       \
                                        slots[F_##id][n].variant)
#define SLOTS(id, name, base, since, P, A, K)                                                      \
    SLOT(id, P, A, K, 0) SLOT(id, P, A, K, 1) SLOT(id, P, A, K, 2) SLOT(id, P, A, K, 3)            \
    SLOT(id, P, A, K, 4) SLOT(id, P, A, K, 5) SLOT(id, P, A, K, 6) SLOT(id, P, A, K, 7)
CALLS(SLOTS)

/* the exported names: the direct route, each bound to libcuda's function of the same name */
#define EXPORT(id, name, base, since, P, A, K)                                                     \
    CUresult name P BODY(id, entry_get(F_##id * NVARIANTS), ROUTE_DIRECT, A, K, 0)                 \
    CUresult name##_ptsz P BODY(id, entry_get(F_##id * NVARIANTS + 1), ROUTE_DIRECT, A, K, 1)      \
    CUresult name##_ptds P BODY(id, entry_get(F_##id * NVARIANTS + 2), ROUTE_DIRECT, A, K, 2)
CALLS(EXPORT)

/* cuGetProcAddress: the real answer, then a wrapper in place of a pointer of ours */
static void *redirect(const char *sym, void *p, int version, cuuint64_t flags);

#define GETPROC_BODY(id, realexpr, route, A, st)                                                   \
    {                                                                                              \
        bump(F_##id, route);                                                                       \
        void *r_ = (realexpr);                                                                     \
        if (__builtin_expect(!r_, 0)) return CUDA_ERROR_NOT_FOUND;                                 \
        CUresult rc_ = ((id##_t)r_) A;                                                             \
        if (rc_ == 0 && pfn && *pfn && sym) *pfn = redirect(sym, *pfn, ver, fl);                       \
        return rc_;                                                                                \
    }
#define GETPROC_SLOT(id, P, A, K, n)                                                               \
    static CUresult id##_slot##n P GETPROC_BODY(id, slots[F_##id][n].real, slots[F_##id][n].route, A, K)
#define GETPROC_SLOTS(id, name, base, since, P, A, K)                                              \
    GETPROC_SLOT(id, P, A, K, 0) GETPROC_SLOT(id, P, A, K, 1) GETPROC_SLOT(id, P, A, K, 2)         \
    GETPROC_SLOT(id, P, A, K, 3) GETPROC_SLOT(id, P, A, K, 4) GETPROC_SLOT(id, P, A, K, 5)         \
    GETPROC_SLOT(id, P, A, K, 6) GETPROC_SLOT(id, P, A, K, 7)
GETPROCS(GETPROC_SLOTS)
#define GETPROC_EXPORT(id, name, base, since, P, A, K)                                             \
    CUresult name P GETPROC_BODY(id, entry_get(F_##id * NVARIANTS), ROUTE_DIRECT, A, K)            \
    CUresult name##_ptsz P GETPROC_BODY(id, entry_get(F_##id * NVARIANTS + 1), ROUTE_DIRECT, A, K) \
    CUresult name##_ptds P GETPROC_BODY(id, entry_get(F_##id * NVARIANTS + 2), ROUTE_DIRECT, A, K)
GETPROCS(GETPROC_EXPORT)

#define SLOT_TABLE(id, name, base, since, P, A, K)                                                 \
    {(void *)id##_slot0, (void *)id##_slot1, (void *)id##_slot2, (void *)id##_slot3,               \
     (void *)id##_slot4, (void *)id##_slot5, (void *)id##_slot6, (void *)id##_slot7},
static void *const slot_fns[NCALLS][NSLOT] = {CALLS(SLOT_TABLE) GETPROCS(SLOT_TABLE)};

/* The wrapper of kind `call` bound to real pointer `real` for `route` (the real one when all
   slots are taken). */
static void *wrap(int call, void *real, int route, int variant) {
    void *out = NULL;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < slots_used[call] && !out; i++)
        if (slots[call][i].real == real && slots[call][i].route == route) out = slot_fns[call][i];
    if (!out && slots_used[call] < NSLOT) {
        int i = slots_used[call];
        slots[call][i].route = route;
        slots[call][i].variant = variant;
        __atomic_store_n(&slots[call][i].real, real, __ATOMIC_RELEASE);
        slots_used[call] = i + 1;
        out = slot_fns[call][i];
    }
    pthread_mutex_unlock(&lock);
    if (!out) {
        __atomic_fetch_add(&n_slots_full, 1, __ATOMIC_RELAXED);
        return real;
    }
    return out;
}

#define EXPORT_TABLE(id, name, base, since, P, A, K) (void *)name, (void *)name##_ptsz, (void *)name##_ptds,
static void *const export_fns[] = {CALLS(EXPORT_TABLE) GETPROCS(EXPORT_TABLE)};

/* one of our functions: a wrapper handed out, or an exported name (already counted as direct) */
static int is_ours(void *p) {
    for (int c = 0; c < NCALLS; c++)
        for (int i = 0; i < NSLOT; i++)
            if (slot_fns[c][i] == p) return 1;
    for (size_t i = 0; i < sizeof export_fns / sizeof export_fns[0]; i++)
        if (export_fns[i] == p) return 1;
    return 0;
}

static void note_skipped(const char *sym, int version) {
    pthread_mutex_lock(&lock);
    int known = 0;
    for (int i = 0; i < n_skipped && !known; i++) known = !strcmp(skipped[i], sym);
    if (!known && n_skipped < MAX_SKIPPED) {
        skipped[n_skipped] = strdup(sym);
        skipped_version[n_skipped++] = version;
    }
    pthread_mutex_unlock(&lock);
}

static void *redirect(const char *sym, void *p, int version, cuuint64_t flags) {
    if (is_ours(p)) return p;
    int best = -1, ours = 0;
    for (int i = 0; i < NENTRIES; i++) {
        if (strcmp(entries[i].base, sym)) continue;
        ours = 1;
        requested[entries[i].call] = 1;
        if (entry_get(i) == p) {
            __atomic_fetch_add(&n_getproc_identity, 1, __ATOMIC_RELAXED);
            return wrap(entries[i].call, p, ROUTE_GETPROC, i % NVARIANTS);
        }
        if (entries[i].since <= version && (best < 0 || entries[i].since > entries[best].since))
            best = i;
    }
    if (!ours) {
        __atomic_fetch_add(&n_getproc_other, 1, __ATOMIC_RELAXED);
        return p;
    }
    if (best >= 0 && version <= MAX_GUESSED_VERSION) {
        __atomic_fetch_add(&n_getproc_by_name, 1, __ATOMIC_RELAXED);
        /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (2): the per-thread-stream variant */
        return wrap(entries[best].call, p, ROUTE_GETPROC, (flags & 2) ? 1 : 0);
    }
    note_skipped(sym, version); /* an older signature than ours, or a version we do not know */
    return p;
}

/* ---- dlsym */

/* The forward of dlsym must be a tail call (see dlsym below): guaranteed where the compiler has
   musttail (clang), else by the sibling-call optimisation of -O2, the build's flags (GCC 12 has
   no musttail); tests/test_intercept.py fails if it is not one. */
#if defined(__has_attribute)
#if __has_attribute(musttail)
#define TAIL_CALL __attribute__((musttail))
#endif
#endif
#ifndef TAIL_CALL
#define TAIL_CALL
#endif

static void *on_dlsym(const char *symbol, void *r) {
    for (int i = 0; i < NENTRIES; i++) {
        if (strcmp(entries[i].name, symbol)) continue;
        if (entry_get(i) != r) return r; /* not libcuda's (our own export, another library) */
        __atomic_fetch_add(&n_dlsym_wrapped, 1, __ATOMIC_RELAXED);
        return wrap(entries[i].call, r, ROUTE_DLSYM, i % NVARIANTS);
    }
    return r;
}

void *dlsym(void *handle, const char *symbol) {
    void *(*dl)(void *, const char *) = get_real_dlsym();
    if (__builtin_expect(!dl, 0)) return NULL;
    /* RTLD_NEXT and RTLD_DEFAULT resolve relative to the caller: a tail call keeps its return
       address for libc to see. Our exported names are found through the global scope anyway. */
    if (handle == RTLD_NEXT || handle == RTLD_DEFAULT || symbol[0] != 'c' || symbol[1] != 'u')
        TAIL_CALL return dl(handle, symbol);
    void *r = dl(handle, symbol);
    return r ? on_dlsym(symbol, r) : r;
}

/* ---- reading the counts (ctypes in the program, and the file at exit) */
int gpuos_intercept_ncalls(void) { return NCALLS; }
const char *gpuos_intercept_call_name(int i) { return i >= 0 && i < NCALLS ? call_names[i] : NULL; }

/* out[i]: calls of kind i so far, every route together */
void gpuos_intercept_totals(uint64_t *out) {
    for (int c = 0; c < NCALLS; c++) {
        uint64_t sum = 0;
        for (int r = 0; r < NROUTES; r++) sum += __atomic_load_n(&calls[c][r], __ATOMIC_RELAXED);
        out[c] = sum;
    }
}

static void put_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

/* The counts as one JSON object, to path (written beside it, then renamed). 0 or -1. */
int gpuos_intercept_dump(const char *path) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid()) >= (int)sizeof tmp) return -1;
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    char where[4096] = "";
    Dl_info info;
    void *probe = cuda_handle ? get_real_dlsym()(cuda_handle, "cuInit") : NULL;
    if (probe && dladdr(probe, &info) && info.dli_fname) snprintf(where, sizeof where, "%s", info.dli_fname);
    fprintf(f, "{\"tool\": \"gpuos_intercept\", \"pid\": %d, \"libcuda\": ", (int)getpid());
    if (where[0]) put_json_string(f, where);
    else fputs("null", f);
    fputs(", \"routes\": [\"direct\", \"dlsym\", \"getproc\"], \"calls\": {", f);
    int first = 1;
    for (int c = 0; c < NCALLS; c++) {
        uint64_t v[NROUTES], sum = 0;
        for (int r = 0; r < NROUTES; r++) sum += v[r] = __atomic_load_n(&calls[c][r], __ATOMIC_RELAXED);
        if (!sum) continue;
        fprintf(f, "%s\"%s\": [%llu, %llu, %llu]", first ? "" : ", ", call_names[c],
                (unsigned long long)v[0], (unsigned long long)v[1], (unsigned long long)v[2]);
        first = 0;
    }
    fputs("}, \"kernels\": [", f);
    first = 1;
    for (size_t i = 0; i < KCAP; i++) {
        void *fn = __atomic_load_n(&kernels[i].func, __ATOMIC_ACQUIRE);
        uint64_t n = __atomic_load_n(&kernels[i].launches, __ATOMIC_RELAXED);
        if (!fn || !n) continue;
        fprintf(f, "%s{\"func\": %llu, \"launches\": %llu, \"name\": ", first ? "" : ", ",
                (unsigned long long)(uintptr_t)fn, (unsigned long long)n);
        const char *name = __atomic_load_n(&kernels[i].name, __ATOMIC_ACQUIRE);
        if (name) put_json_string(f, name);
        else fputs("null", f);
        fputc('}', f);
        first = 0;
    }
    fprintf(f, "], \"kernels_dropped\": %llu, \"getproc\": {\"identity\": %llu, \"by_name\": %llu, "
               "\"other\": %llu, \"requested\": [",
            (unsigned long long)n_kernels_dropped, (unsigned long long)n_getproc_identity,
            (unsigned long long)n_getproc_by_name, (unsigned long long)n_getproc_other);
    first = 1;
    for (int c = 0; c < NCALLS; c++) {
        if (!requested[c]) continue;
        fprintf(f, "%s\"%s\"", first ? "" : ", ", call_names[c]);
        first = 0;
    }
    fputs("], \"skipped\": [", f);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_skipped; i++) {
        fprintf(f, "%s{\"name\": ", i ? ", " : "");
        put_json_string(f, skipped[i]);
        fprintf(f, ", \"version\": %d}", skipped_version[i]);
    }
    fputs("]}, \"slots\": {", f);
    first = 1;
    for (int c = 0; c < NCALLS; c++) {
        if (!slots_used[c]) continue;
        fprintf(f, "%s\"%s\": [", first ? "" : ", ", call_names[c]);
        for (int i = 0; i < slots_used[c]; i++)
            fprintf(f, "%s\"%s\"", i ? ", " : "", route_names[slots[c][i].route]);
        fputc(']', f);
        first = 0;
    }
    pthread_mutex_unlock(&lock);
    fprintf(f, "}, \"slots_full\": %llu, \"dlsym_wrapped\": %llu}\n", (unsigned long long)n_slots_full,
            (unsigned long long)n_dlsym_wrapped);
    int bad = ferror(f);
    bad |= fclose(f);
    if (bad || rename(tmp, path)) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int any_calls(void) {
    for (int c = 0; c < NCALLS; c++)
        for (int r = 0; r < NROUTES; r++)
            if (__atomic_load_n(&calls[c][r], __ATOMIC_RELAXED)) return 1;
    return 0;
}

/* GPUOS_INTERCEPT_OUT with %p replaced by the pid; 0 when unset or too long */
static int out_path(char *dst, size_t cap) {
    const char *spec = getenv("GPUOS_INTERCEPT_OUT");
    if (!spec || !*spec) return 0;
    size_t n = 0;
    for (const char *s = spec; *s; s++) {
        int w = (s[0] == '%' && s[1] == 'p') ? snprintf(dst + n, cap - n, "%d", (int)getpid())
                                             : snprintf(dst + n, cap - n, "%c", *s);
        if (w < 0 || (size_t)w >= cap - n) return 0;
        n += (size_t)w;
        if (s[0] == '%' && s[1] == 'p') s++;
    }
    return 1;
}

/* A forked child starts from nothing: its parent's calls are not its own. */
static void forked_child(void) {
    memset(calls, 0, sizeof calls);
    for (size_t i = 0; i < KCAP; i++) kernels[i].launches = 0;
    n_getproc_identity = n_getproc_by_name = n_getproc_other = n_dlsym_wrapped = 0;
    n_slots_full = n_kernels_dropped = 0;
}

__attribute__((constructor)) static void at_load(void) {
    const char *names = getenv("GPUOS_INTERCEPT_NAMES");
    want_names = !(names && names[0] == '0');
    pthread_atfork(NULL, NULL, forked_child);
}

__attribute__((destructor)) static void at_exit_dump(void) {
    char path[4096];
    if (any_calls() && out_path(path, sizeof path)) gpuos_intercept_dump(path);
}

#ifdef GPUOS_AGENT
/* ---- starting and stopping the agent's front end (injection/start.py) */

int gpuos_intercept_nentries(void) { return NENTRIES; }
/* the name of entry i: the id of its calls in the records is i */
const char *gpuos_intercept_entry_name(int i) { return i >= 0 && i < NENTRIES ? entries[i].name : NULL; }

static void *real_lookup(const char *name) {
    void *h = cuda();
    void *(*dl)(void *, const char *) = get_real_dlsym();
    return h && dl ? dl(h, name) : NULL;
}

static void stop_recording(void) { __atomic_store_n(&agent_on, 0, __ATOMIC_RELEASE); } /* gpu-trace went away */

/* Records to fd from now on, and the agent's core is fed. kinds: n pairs (entry index, kind).
   0, or -2 when the driver cannot be loaded, -7 when the writer thread cannot start. */
int gpuos_intercept_start(int fd, const uint32_t *kinds, int n, int flush_ms, int check) {
    if (!cuda()) return -2;
    rec_resolve(real_lookup);
    rec_configure(fd, kinds, n, flush_ms, check);
    if (rec_start(stop_recording)) return -7;
    __atomic_store_n(&agent_on, 1, __ATOMIC_RELEASE);
    return 0;
}

/* Stop recording, ship what is left. counters: as gpuos_trace_stop's. */
void gpuos_intercept_stop(uint64_t counters[4]) {
    stop_recording();
    rec_finish(counters);
}
#endif
