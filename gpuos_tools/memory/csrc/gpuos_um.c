/*
 * gpuos managed-memory allocator for PyTorch: the fault-driven unified-memory baseline of
 * scripts/bench_online_torch.py (gpuos_tools/memory/managed.py drives it; not the agent's
 * allocator, which is gpuos_alloc.c).
 *
 *   torch.cuda.memory.CUDAPluggableAllocator(path, "gpuos_um_malloc", "gpuos_um_free")
 *   void *alloc(ssize_t size, int device, void *stream); void free(void *ptr, ssize_t size, int device, void *stream)
 *
 * Every block is its own managed allocation (cuMemAllocManaged, CU_MEM_ATTACH_GLOBAL). Sizes are
 * rounded to the classes of the owned allocator's PyTorch cache (gpuos_torch_round with a 2 MiB
 * granule: up to 1 MiB a power of two from 512 B, above it a quarter of the power of two below,
 * then 2 MiB), and a freed block waits in its class's list for a request on the same stream
 * (stream order makes that safe; blocks freed on another stream are not reused). Nothing is ever
 * given back to the driver before the process ends: no free synchronises the device.
 *
 * The limit: at the first allocation the GPU's free memory is read (cuMemGetInfo) and the
 * managed bytes may never exceed it less gpuos_um_init's reserve (memory that is not managed:
 * cuBLAS workspaces, the context's growth). A request past it is refused: with a nonzero
 * refuse_exit the process says why on stderr and exits with that status at once (torch does not
 * check a pluggable allocator's NULL: a kernel would write at address 0), else NULL is returned
 * and gpuos_um_stats counts it (the CPU tests). So the managed memory never oversubscribes the
 * GPU itself, and the driver never evicts on its own.
 *
 * The log: every block handed out (new or from the cache) is appended to a ring (base, size)
 * with a counter that Python reads without a call (gpuos_um_nlog), so that the software budget
 * sees which blocks an operation allocated (its outputs, its temporaries, workspaces taken from
 * the allocator) after it ran.
 *
 * gpuos_um_evict(ptr, size, stream): cuMemPrefetchAsync of the range to the host, stream-ordered
 * (cuMemPrefetchAsync_v2 with CU_MEM_LOCATION_TYPE_HOST; the older symbol with CU_DEVICE_CPU
 * where there is no _v2).
 *
 * No CUDA header is needed. Build: cc -O2 -shared -fPIC -I../include -o libgpuos_um.so gpuos_um.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "gpuos_sizeclass.h"

typedef uint64_t CUdeviceptr;
typedef void *CUstream;
typedef struct { int type; int id; } mem_location_t; /* CUmemLocation; CU_MEM_LOCATION_TYPE_HOST = 2 */

typedef int (*alloc_managed_t)(CUdeviceptr *, size_t, unsigned);
typedef int (*get_info_t)(size_t *, size_t *);
typedef int (*prefetch_v2_t)(CUdeviceptr, size_t, mem_location_t, unsigned, CUstream);
typedef int (*prefetch_v1_t)(CUdeviceptr, size_t, int, CUstream);

static alloc_managed_t p_alloc;
static get_info_t p_info;
static prefetch_v2_t p_prefetch2;
static prefetch_v1_t p_prefetch1;

#define GRANULE ((size_t)2 << 20)
#define LOGN 65536 /* a power of two */

/* the log Python reads (managed.py): entry i of the ring is at i % LOGN */
uint64_t gpuos_um_nlog;
uint64_t gpuos_um_log_ptr[LOGN];
uint64_t gpuos_um_log_size[LOGN];

typedef struct { uint64_t ptr; CUstream stream; } cblock_t;
typedef struct { uint64_t size; cblock_t *v; size_t n, cap; } bucket_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static bucket_t *buckets;
static size_t n_buckets, cap_buckets;
static uint64_t reserve_bytes, limit_bytes; /* limit: 0 until the first allocation */
static int limit_known;
static int refuse_exit;
static uint64_t free_at_start;
static uint64_t stats[10];
enum { S_BLOCKS, S_BYTES, S_HITS, S_MISSES, S_CACHED_BYTES, S_REFUSED, S_REFUSED_BYTES, S_LIMIT, S_DRIVER_ERRORS,
       S_LAST_ERROR };

/* 0 when ready; -1 dlopen failed, -2 a symbol is missing. reserve: bytes of the GPU's free
   memory left to what is not managed; exit_code: see "The limit" above (0: return NULL). */
int gpuos_um_init(const char *libcuda_path, uint64_t reserve, int exit_code) {
    void *cuda = dlopen(libcuda_path ? libcuda_path : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) return -1;
    alloc_managed_t a = (alloc_managed_t)dlsym(cuda, "cuMemAllocManaged");
    p_info = (get_info_t)dlsym(cuda, "cuMemGetInfo_v2");
    p_prefetch2 = (prefetch_v2_t)dlsym(cuda, "cuMemPrefetchAsync_v2");
    p_prefetch1 = (prefetch_v1_t)dlsym(cuda, "cuMemPrefetchAsync");
    if (!a || !p_info || (!p_prefetch2 && !p_prefetch1)) return -2;
    reserve_bytes = reserve;
    refuse_exit = exit_code;
    __atomic_store_n(&p_alloc, a, __ATOMIC_RELEASE);
    return 0;
}

size_t gpuos_um_round(size_t size) { return gpuos_size_class(size, GRANULE); }

static bucket_t *bucket(uint64_t size, int make) { /* lock held */
    for (size_t i = 0; i < n_buckets; i++)
        if (buckets[i].size == size) return &buckets[i];
    if (!make) return NULL;
    if (n_buckets == cap_buckets) {
        size_t cap = cap_buckets ? cap_buckets * 2 : 64;
        bucket_t *t = realloc(buckets, cap * sizeof *t);
        if (!t) return NULL;
        buckets = t;
        cap_buckets = cap;
    }
    buckets[n_buckets] = (bucket_t){size, NULL, 0, 0};
    return &buckets[n_buckets++];
}

static void note(uint64_t ptr, uint64_t size) { /* lock held */
    uint64_t i = gpuos_um_nlog;
    gpuos_um_log_ptr[i % LOGN] = ptr;
    gpuos_um_log_size[i % LOGN] = size;
    __atomic_store_n(&gpuos_um_nlog, i + 1, __ATOMIC_RELEASE);
}

void *gpuos_um_malloc(ssize_t size, int device, void *stream) {
    (void)device;
    if (size <= 0 || !__atomic_load_n(&p_alloc, __ATOMIC_ACQUIRE)) return NULL;
    size_t r = gpuos_um_round((size_t)size);
    pthread_mutex_lock(&lock);
    bucket_t *b = bucket(r, 0);
    if (b) {
        for (size_t i = b->n; i-- > 0;) { /* the newest freed on this stream */
            if (b->v[i].stream == stream) {
                uint64_t p = b->v[i].ptr;
                memmove(&b->v[i], &b->v[i + 1], (b->n - i - 1) * sizeof *b->v);
                b->n--;
                stats[S_HITS]++;
                stats[S_CACHED_BYTES] -= r;
                note(p, r);
                pthread_mutex_unlock(&lock);
                return (void *)(uintptr_t)p;
            }
        }
    }
    if (!limit_known) {
        size_t free_b = 0, total_b = 0;
        int err = p_info(&free_b, &total_b);
        if (err) {
            stats[S_DRIVER_ERRORS]++;
            stats[S_LAST_ERROR] = (uint64_t)err;
            pthread_mutex_unlock(&lock);
            return NULL;
        }
        free_at_start = free_b;
        limit_bytes = free_b > reserve_bytes ? free_b - reserve_bytes : 0;
        stats[S_LIMIT] = limit_bytes;
        limit_known = 1;
    }
    if (stats[S_BYTES] + r > limit_bytes) {
        stats[S_REFUSED]++;
        stats[S_REFUSED_BYTES] = r;
        uint64_t held = stats[S_BYTES];
        pthread_mutex_unlock(&lock);
        if (refuse_exit) {
            fprintf(stderr,
                    "gpuos_um: refusing %zu more bytes of managed memory: the job would hold %llu bytes, past the "
                    "GPU's free memory (%llu bytes when it started) less %llu bytes kept for what is not managed; "
                    "the baseline never oversubscribes the GPU itself\n",
                    r, (unsigned long long)(held + r), (unsigned long long)free_at_start,
                    (unsigned long long)reserve_bytes);
            fflush(stderr);
            _exit(refuse_exit);
        }
        return NULL;
    }
    stats[S_BYTES] += r; /* counted before the call, so that two threads cannot pass the limit */
    pthread_mutex_unlock(&lock);
    CUdeviceptr p = 0;
    int err = p_alloc(&p, r, 1 /* CU_MEM_ATTACH_GLOBAL */);
    pthread_mutex_lock(&lock);
    if (err || !p) {
        stats[S_BYTES] -= r;
        stats[S_DRIVER_ERRORS]++;
        stats[S_LAST_ERROR] = (uint64_t)err;
        pthread_mutex_unlock(&lock);
        return NULL;
    }
    stats[S_BLOCKS]++;
    stats[S_MISSES]++;
    note(p, r);
    pthread_mutex_unlock(&lock);
    return (void *)(uintptr_t)p;
}

void gpuos_um_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)device;
    if (!ptr || size <= 0) return;
    size_t r = gpuos_um_round((size_t)size);
    pthread_mutex_lock(&lock);
    bucket_t *b = bucket(r, 1);
    if (b && b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 16;
        cblock_t *t = realloc(b->v, cap * sizeof *t);
        if (t) { b->v = t; b->cap = cap; }
    }
    if (b && b->n < b->cap) {
        b->v[b->n++] = (cblock_t){(uint64_t)(uintptr_t)ptr, stream};
        stats[S_CACHED_BYTES] += r;
    } /* else no memory for the list: the block is lost to the cache (still counted) */
    pthread_mutex_unlock(&lock);
}

/* Push [ptr, ptr + size) to host memory, ordered on stream; the CUresult. */
int gpuos_um_evict(uint64_t ptr, uint64_t size, void *stream) {
    if (p_prefetch2) {
        mem_location_t host = {2 /* CU_MEM_LOCATION_TYPE_HOST */, 0};
        return p_prefetch2(ptr, size, host, 0, stream);
    }
    return p_prefetch1(ptr, size, -1 /* CU_DEVICE_CPU */, stream);
}

/* blocks, managed bytes, cache hits, misses, cached bytes, refused requests, the last refused
   request's bytes, the limit (0 before the first allocation), driver errors, the last error */
void gpuos_um_stats(uint64_t out[10]) {
    pthread_mutex_lock(&lock);
    memcpy(out, stats, sizeof stats);
    pthread_mutex_unlock(&lock);
}
