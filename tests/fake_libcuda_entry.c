/*
 * The stand-in driver (fake_libcuda.c) with the entry points that driver-API interception
 * (gpuos_tools/injection/csrc/gpuos_intercept.c) stands in front of: launches, a few copies and
 * allocations, cuFuncGetName, and cuGetProcAddress / cuGetProcAddress_v2 answering by name,
 * version and per-thread-stream flag as the driver does. Every call is counted here too, so a
 * test can hold the interposer's counts against what the driver really received, and the last
 * launch's arguments are kept, so that it can check they were forwarded intact.
 *
 * Built as libcuda.so.1 (its soname) with -Bsymbolic: like the real driver, the addresses its
 * cuGetProcAddress hands out are its own functions, not whatever a preloaded library exports.
 * Its internal calls go to static functions, never through its exported names.
 */
#include "fake_libcuda.c"

#include <stdio.h>

enum {
    C_LAUNCH, C_LAUNCH_PTSZ, C_LAUNCH_EX, C_LAUNCH_COOP, C_GRAPH_LAUNCH, C_ALLOC_V1, C_ALLOC_V2,
    C_FREE_V2, C_HTOD, C_DTOH, C_MEMSET_D32_ASYNC, C_GETPROC_V1, C_GETPROC_V2, C_FUNC_NAME, NCOUNTS
};
static int64_t counts[NCOUNTS];
static uint64_t last_launch[11]; /* f, grid xyz, block xyz, smem, stream, params, extra */

static void count(int c) { __atomic_add_fetch(&counts[c], 1, __ATOMIC_RELAXED); }

static void keep_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, void *s, void **kp, void **ex) {
    uint64_t v[11] = {(uint64_t)(uintptr_t)f, gx, gy, gz, bx, by, bz, smem, (uint64_t)(uintptr_t)s,
                      (uint64_t)(uintptr_t)kp, (uint64_t)(uintptr_t)ex};
    pthread_mutex_lock(&m);
    memcpy(last_launch, v, sizeof v);
    pthread_mutex_unlock(&m);
}

int cuInit(unsigned flags) { return flags ? INVALID_VALUE : OK; }

int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *s, void **kp, void **ex) {
    count(C_LAUNCH);
    keep_launch(f, gx, gy, gz, bx, by, bz, smem, s, kp, ex);
    return f ? OK : INVALID_VALUE;
}

int cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, void *s, void **kp, void **ex) {
    count(C_LAUNCH_PTSZ);
    keep_launch(f, gx, gy, gz, bx, by, bz, smem, s, kp, ex);
    return f ? OK : INVALID_VALUE;
}

int cuLaunchKernelEx(const void *cfg, void *f, void **kp, void **ex) {
    count(C_LAUNCH_EX);
    keep_launch(f, 0, 0, 0, 0, 0, 0, 0, (void *)cfg, kp, ex);
    return f && cfg ? OK : INVALID_VALUE;
}

int cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned smem, void *s, void **kp) {
    count(C_LAUNCH_COOP);
    keep_launch(f, gx, gy, gz, bx, by, bz, smem, s, kp, NULL);
    return f ? OK : INVALID_VALUE;
}

int cuGraphLaunch(void *exec, void *stream) {
    (void)stream;
    count(C_GRAPH_LAUNCH);
    return exec ? OK : INVALID_VALUE;
}

/* the CUDA 2.x signature: 32-bit device pointers and sizes */
int cuMemAlloc(uint32_t *p, unsigned n) {
    count(C_ALLOC_V1);
    if (!n) return INVALID_VALUE;
    *p = 0x1000u + n;
    return OK;
}

int cuMemAlloc_v2(uint64_t *p, size_t n) {
    count(C_ALLOC_V2);
    if (!n) return INVALID_VALUE;
    pthread_mutex_lock(&m);
    *p = next_va;
    next_va += (n + GRANULE - 1) / GRANULE * GRANULE + GRANULE;
    pthread_mutex_unlock(&m);
    return OK;
}

int cuMemFree_v2(uint64_t p) {
    count(C_FREE_V2);
    return p ? OK : INVALID_VALUE;
}

int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t n) {
    count(C_HTOD);
    return dst && (src || !n) ? OK : INVALID_VALUE;
}

int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t n) {
    count(C_DTOH);
    if (!dst || !src) return INVALID_VALUE;
    memset(dst, 0x5a, n);
    return OK;
}

int cuMemsetD32Async(uint64_t dst, unsigned value, size_t n, void *stream) {
    (void)value; (void)n; (void)stream;
    count(C_MEMSET_D32_ASYNC);
    return dst ? OK : INVALID_VALUE;
}

/* what this driver hands out for cuMemsetD32Async: a function that is not its exported symbol */
static int memset_d32_async_inside(uint64_t dst, unsigned value, size_t n, void *stream) {
    (void)value; (void)n; (void)stream;
    count(C_MEMSET_D32_ASYNC);
    return dst ? OK : INVALID_VALUE;
}

static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { void *f; char name[40]; } names[4096];
static int n_names;

int cuFuncGetName(const char **name, void *f) {
    count(C_FUNC_NAME);
    if (!name || !f) return INVALID_VALUE;
    pthread_mutex_lock(&names_lock);
    int i = 0;
    while (i < n_names && names[i].f != f) i++;
    if (i == n_names) {
        if (n_names == 4096) { pthread_mutex_unlock(&names_lock); return OUT_OF_MEMORY; }
        names[i].f = f;
        snprintf(names[i].name, sizeof names[i].name, "fake_kernel_%llx", (unsigned long long)(uintptr_t)f);
        n_names++;
    }
    *name = names[i].name;
    pthread_mutex_unlock(&names_lock);
    return OK;
}

/* What the agent's front ends ask of the driver: every kernel takes two 8-byte parameters here
   (cuFuncGetParamInfo answers INVALID_VALUE past the last one, as the driver does); one context;
   no stream is ever capturing; streams and modules are numbers. */
int cuFuncGetParamInfo(void *f, size_t index, size_t *offset, size_t *size) {
    if (!f || !offset || !size) return INVALID_VALUE;
    if (index >= 2) return INVALID_VALUE;
    *offset = index * 8;
    *size = 8;
    return OK;
}

int cuCtxGetCurrent(void **ctx) {
    if (!ctx) return INVALID_VALUE;
    *ctx = (void *)(uintptr_t)0xC0C0000ull;
    return OK;
}

int cuStreamIsCapturing(void *stream, int *status) {
    (void)stream;
    if (!status) return INVALID_VALUE;
    *status = 0;
    return OK;
}

static uint64_t next_handle_id = 0x5000;

int cuStreamCreate(void **stream, unsigned flags) {
    (void)flags;
    if (!stream) return INVALID_VALUE;
    *stream = (void *)(uintptr_t)__atomic_add_fetch(&next_handle_id, 0x10, __ATOMIC_RELAXED);
    return OK;
}

int cuStreamDestroy_v2(void *stream) { return stream ? OK : INVALID_VALUE; }

static void *last_module;

int cuModuleLoadData(void **module, const void *image) {
    if (!module || !image) return INVALID_VALUE;
    *module = (void *)(uintptr_t)__atomic_add_fetch(&next_handle_id, 0x10, __ATOMIC_RELAXED);
    __atomic_store_n(&last_module, *module, __ATOMIC_RELAXED);
    return OK;
}

int cuModuleUnload(void *module) { return module ? OK : INVALID_VALUE; }

/* a module's function fake_kernel_<hex> is the handle <hex>; every module has one 8-byte
   variable of any name, at an address that depends on the module */
int cuModuleGetFunction(void **f, void *module, const char *name) {
    if (!f || !module || !name || strncmp(name, "fake_kernel_", 12)) return INVALID_VALUE;
    *f = (void *)(uintptr_t)strtoull(name + 12, NULL, 16);
    return OK;
}

/* the handle 0x100010 is a kernel of the last module loaded (a library's, handed out unseen, as
   cuFFT's are); of the others the driver cannot say */
int cuFuncGetModule(void **module, void *f) {
    if (!module || (uintptr_t)f != 0x100010 || !last_module) return INVALID_VALUE;
    *module = __atomic_load_n(&last_module, __ATOMIC_RELAXED);
    return OK;
}

int cuModuleGetGlobal_v2(uint64_t *dptr, size_t *bytes, void *module, const char *name) {
    if (!module || !name) return INVALID_VALUE;
    if (dptr) *dptr = 0x7e0000000000ull + 0x10 * (uint64_t)(uintptr_t)module;
    if (bytes) *bytes = 8;
    return OK;
}

/* name, the version that introduced this answer, per-thread-stream variant, the function */
typedef struct { const char *name; int since, ptds; void *fn; } proc_t;
static int getproc_v1(const char *, void **, int, uint64_t);
static int getproc_v2(const char *, void **, int, uint64_t, int *);
static const proc_t procs[] = {
    {"cuInit", 2000, 0, (void *)cuInit},
    {"cuLaunchKernel", 4000, 0, (void *)cuLaunchKernel},
    {"cuLaunchKernel", 7000, 1, (void *)cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", 11060, 0, (void *)cuLaunchKernelEx},
    {"cuLaunchCooperativeKernel", 9000, 0, (void *)cuLaunchCooperativeKernel},
    {"cuGraphLaunch", 10000, 0, (void *)cuGraphLaunch},
    {"cuMemAlloc", 2000, 0, (void *)cuMemAlloc},
    {"cuMemAlloc", 3020, 0, (void *)cuMemAlloc_v2},
    {"cuMemFree", 3020, 0, (void *)cuMemFree_v2},
    {"cuMemcpyHtoD", 3020, 0, (void *)cuMemcpyHtoD_v2},
    {"cuMemcpyDtoH", 3020, 0, (void *)cuMemcpyDtoH_v2},
    {"cuMemsetD32Async", 3020, 0, (void *)memset_d32_async_inside},
    {"cuMemCreate", 10020, 0, (void *)cuMemCreate},
    {"cuMemRelease", 10020, 0, (void *)cuMemRelease},
    {"cuMemMap", 10020, 0, (void *)cuMemMap},
    {"cuMemUnmap", 10020, 0, (void *)cuMemUnmap},
    {"cuMemAddressReserve", 10020, 0, (void *)cuMemAddressReserve},
    {"cuMemAddressFree", 10020, 0, (void *)cuMemAddressFree},
    {"cuFuncGetName", 12030, 0, (void *)cuFuncGetName},
    {"cuModuleGetFunction", 2000, 0, (void *)cuModuleGetFunction},
    {"cuFuncGetModule", 11000, 0, (void *)cuFuncGetModule},
    {"cuModuleGetGlobal", 3020, 0, (void *)cuModuleGetGlobal_v2},
    {"cuStreamDestroy", 4000, 0, (void *)cuStreamDestroy_v2},
    {"cuGetProcAddress", 11030, 0, (void *)getproc_v1},
    {"cuGetProcAddress", 12000, 0, (void *)getproc_v2},
};

#define PER_THREAD_DEFAULT_STREAM 2
#define DRIVER_VERSION 13000

static int lookup(const char *sym, void **pfn, int version, uint64_t flags, int *status) {
    if (!sym || !pfn) return INVALID_VALUE;
    if (version > DRIVER_VERSION) return INVALID_VALUE;
    int want_ptds = (flags & PER_THREAD_DEFAULT_STREAM) != 0;
    const proc_t *best = NULL;
    for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
        const proc_t *p = &procs[i];
        if (strcmp(p->name, sym) || p->since > version || (p->ptds && !want_ptds)) continue;
        if (!best || p->since > best->since || (p->since == best->since && p->ptds)) best = p;
    }
    *pfn = best ? best->fn : NULL;
    if (status) *status = best ? 0 : 1; /* SUCCESS, SYMBOL_NOT_FOUND */
    return OK;
}

static int getproc_v1(const char *sym, void **pfn, int version, uint64_t flags) {
    count(C_GETPROC_V1);
    return lookup(sym, pfn, version, flags, NULL);
}

static int getproc_v2(const char *sym, void **pfn, int version, uint64_t flags, int *status) {
    count(C_GETPROC_V2);
    return lookup(sym, pfn, version, flags, status);
}

int cuGetProcAddress(const char *sym, void **pfn, int version, uint64_t flags) {
    return getproc_v1(sym, pfn, version, flags);
}

int cuGetProcAddress_v2(const char *sym, void **pfn, int version, uint64_t flags, int *status) {
    return getproc_v2(sym, pfn, version, flags, status);
}

/* for the tests: the calls received, in the order of the enum above */
int fake_entry_counts(int64_t *out, int n) {
    for (int i = 0; i < n && i < NCOUNTS; i++) out[i] = __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
    return NCOUNTS;
}

void fake_last_launch(uint64_t out[11]) {
    pthread_mutex_lock(&m);
    memcpy(out, last_launch, sizeof last_launch);
    pthread_mutex_unlock(&m);
}
