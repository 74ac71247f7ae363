/*
 * gpuos owned allocations: a device-memory allocator on the CUDA virtual memory API, so that the
 * agent can take a buffer's physical memory away and give it back at the same address.
 * (One unit, over 800 lines: the record table, the size-class segments and the driver calls share
 * one lock and static state that nothing else may touch.)
 *
 * Every buffer the program gets lies in a virtual address range of its own (reserved with
 * cuMemAddressReserve, rounded up to the allocation granularity, 2 MiB on Hopper), backed by one
 * physical allocation (cuMemCreate + cuMemMap + cuMemSetAccess). Releasing a buffer unmaps and
 * releases the physical memory but keeps the reservation; making it resident creates physical
 * memory again and maps it at the same address, so every pointer the program holds stays valid.
 *
 * Small requests (up to SMALL_MAX bytes) would waste most of a granule each, so they are carved
 * out of granule-sized "segments" by power-of-two size class; the segment is then the unit of
 * residency (release / make-resident act on the whole segment holding an address).
 *
 * The table of ranges ("records") is readable from Python through gpuos_alloc_table().
 *
 * Locking: one mutex guards the table, and it is never held across a driver call. The driver
 * calls below fire CUPTI callbacks, which in the traced program enter Python and need the GIL;
 * a thread holding the GIL (the program, inside CuPy's malloc) may wait for this mutex, so a
 * thread holding the mutex must never wait for the GIL. Records being released or made resident
 * are marked busy instead; allocation skips busy segments, and a free of a busy record is left
 * to the thread that finishes the residency operation (FREE_PENDING).
 *
 * Entry points for frameworks (same library, no glue code in between):
 *   CuPy   cupy.cuda.memory.CFunctionAllocator(0, gpuos_cupy_malloc, gpuos_cupy_free, owner)
 *          void *malloc(void *param, size_t size, int device); void free(void *param, void *ptr, int device)
 *   torch  torch.cuda.memory.CUDAPluggableAllocator(path, "gpuos_torch_malloc", "gpuos_torch_free")
 *          void *alloc(ssize_t size, int device, void *stream); void free(void *ptr, ssize_t size, int device, void *stream)
 *
 * No CUDA header is needed: the few types are declared below with the layouts of cuda.h.
 * Build: cc -O2 -shared -fPIC -I../include -o libgpuos_alloc.so gpuos_alloc.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "gpuos_sizeclass.h"

/* ---- ABI of the driver's virtual memory API (cuda.h) */
typedef uint64_t CUdeviceptr;
typedef uint64_t CUhandle;
typedef struct { int type; int id; } mem_location_t;          /* CUmemLocation */
typedef struct {                                              /* CUmemAllocationProp */
    int type;                   /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requested_handle_types; /* none = 0 */
    mem_location_t location;    /* CU_MEM_LOCATION_TYPE_DEVICE = 1, device ordinal */
    void *win32_meta;
    unsigned char compression_type, rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
} alloc_prop_t;
typedef struct { mem_location_t location; int flags; } access_desc_t; /* CUmemAccessDesc; RW = 3 */

typedef int (*granularity_t)(size_t *, const alloc_prop_t *, int);
typedef int (*reserve_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef int (*addr_free_t)(CUdeviceptr, size_t);
typedef int (*create_t)(CUhandle *, size_t, const alloc_prop_t *, unsigned long long);
typedef int (*release_t)(CUhandle);
typedef int (*map_t)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long);
typedef int (*unmap_t)(CUdeviceptr, size_t);
typedef int (*set_access_t)(CUdeviceptr, size_t, const access_desc_t *, size_t);
typedef int (*ctx_sync_t)(void);
typedef void *CUevent;
typedef void *CUstream;
typedef int (*event_create_t)(CUevent *, unsigned);
typedef int (*event_record_t)(CUevent, CUstream);
typedef int (*event_query_t)(CUevent);
typedef int (*event_destroy_t)(CUevent);

static granularity_t p_granularity;
static reserve_t p_reserve;
static addr_free_t p_addr_free;
static create_t p_create;
static release_t p_release;
static map_t p_map;
static unmap_t p_unmap;
static set_access_t p_set_access;
static ctx_sync_t p_ctx_sync;
static event_create_t p_event_create;
static event_record_t p_event_record;
static event_query_t p_event_query;
static event_destroy_t p_event_destroy;

/* ---- the table */
enum { F_RESIDENT = 1, F_BUSY = 2, F_SMALL = 4, F_FREE_PENDING = 8 };
#define SMALL_MIN_SHIFT GPUOS_CLASS_MIN_SHIFT /* 512 B, CuPy's allocation unit */
#define SMALL_MAX_SHIFT GPUOS_CLASS_SMALL_SHIFT /* 1 MiB */
#define N_CLASSES (SMALL_MAX_SHIFT - SMALL_MIN_SHIFT + 1)
#define MAX_DEVICES 64

/* What Python reads (gpuos_tools/memory/owned.py RECORD mirrors it). */
typedef struct {
    uint64_t base;      /* start of the reserved range (granularity-aligned) */
    uint64_t size;      /* bytes reserved; mapped while resident */
    uint64_t handle;    /* physical allocation; 0 while released */
    uint64_t requested; /* large: bytes asked for; segment: live blocks x block size */
    int32_t device;
    uint32_t flags;     /* F_* */
    uint32_t block;     /* segment: its block size; 0 for a large buffer */
    uint32_t live;      /* segment: live blocks; large: 1 */
} gpuos_alloc_record_t;

typedef struct {
    gpuos_alloc_record_t r;
    uint64_t *bitmap; /* segment: one bit per block, set = in use */
    uint32_t nblocks;
} entry_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static entry_t *table;      /* sorted by base */
static size_t n_entries, cap_entries;
static size_t granule[MAX_DEVICES];
static uint64_t stats[8]; /* see gpuos_alloc_stats */
enum { S_MALLOC, S_FREE, S_RESERVED, S_MAPPED, S_RELEASES, S_RESIDENTS, S_DRIVER_ERRORS, S_LAST_ERROR };
static int last_error;

static int note_error(int err) {
    if (err) {
        __atomic_add_fetch(&stats[S_DRIVER_ERRORS], 1, __ATOMIC_RELAXED);
        last_error = err;
    }
    return err;
}

/* index of the entry whose range holds addr, or -1 (lock held) */
static ssize_t find(uint64_t addr) {
    size_t lo = 0, hi = n_entries;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (table[mid].r.base <= addr) lo = mid + 1; else hi = mid;
    }
    if (lo == 0) return -1;
    entry_t *e = &table[lo - 1];
    return addr < e->r.base + e->r.size ? (ssize_t)(lo - 1) : -1;
}

/* insert (lock held); 0 or ENOMEM */
static int insert(const entry_t *e) {
    if (n_entries == cap_entries) {
        size_t cap = cap_entries ? cap_entries * 2 : 256;
        entry_t *t = realloc(table, cap * sizeof *t);
        if (!t) return ENOMEM;
        table = t;
        cap_entries = cap;
    }
    size_t lo = 0, hi = n_entries;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (table[mid].r.base < e->r.base) lo = mid + 1; else hi = mid;
    }
    memmove(&table[lo + 1], &table[lo], (n_entries - lo) * sizeof *table);
    table[lo] = *e;
    n_entries++;
    return 0;
}

static void erase(size_t i) {
    memmove(&table[i], &table[i + 1], (n_entries - i - 1) * sizeof *table);
    n_entries--;
}

static void fill_prop(alloc_prop_t *prop, int device) {
    memset(prop, 0, sizeof *prop);
    prop->type = 1;
    prop->location.type = 1;
    prop->location.id = device;
}

static size_t granularity(int device) {
    if (device < 0 || device >= MAX_DEVICES) return 0;
    size_t g = __atomic_load_n(&granule[device], __ATOMIC_ACQUIRE);
    if (g) return g;
    alloc_prop_t prop;
    fill_prop(&prop, device);
    if (note_error(p_granularity(&g, &prop, 0 /* minimum */)) || !g) return 0;
    __atomic_store_n(&granule[device], g, __ATOMIC_RELEASE);
    return g;
}

/* ---- parked physical memory
 *
 * cuMemCreate and cuMemRelease make the driver clear physical memory in the background, on a copy
 * engine: for a while afterwards, a host-to-device copy runs at half speed (H200: 26 instead of
 * 52 GB/s while copies run both ways; scripts/probe_swap.py). Unmapping a handle and mapping it
 * again costs nothing of the kind. So a released record's physical allocation may be parked
 * (unmapped, kept) up to park_limit bytes, and make-resident of a record of the same size and
 * device maps a parked one instead of creating memory. Off (limit 0) unless a caller sets it:
 * parked memory is still the process's, so whoever sets a limit counts parked bytes as used
 * (gpu-prefetch-sched's budget does) and trims them when it needs the room or gives memory back.
 * A parked allocation holds whatever its last record held; it never leaves the process. */
typedef struct { CUhandle h; size_t size; int device; } parked_t;
static pthread_mutex_t plock = PTHREAD_MUTEX_INITIALIZER; /* guards the parked list; no driver call under it */
static parked_t *parked;
static size_t n_parked, cap_parked;
static uint64_t park_limit, parked_bytes;
static uint64_t pstats[4];
enum { P_PARKS, P_REUSES, P_DROPPED, P_CREATES };
uint64_t gpuos_alloc_trim_parked(uint64_t keep);

/* A parked handle of exactly size on device (taken out of the list), or 0. */
static CUhandle unpark(size_t size, int device) {
    CUhandle h = 0;
    pthread_mutex_lock(&plock);
    for (size_t i = n_parked; i-- > 0;) { /* the most recently parked first */
        if (parked[i].size == size && parked[i].device == device) {
            h = parked[i].h;
            parked[i] = parked[--n_parked];
            __atomic_store_n(&parked_bytes, parked_bytes - size, __ATOMIC_RELEASE); /* read without plock */
            break;
        }
    }
    pthread_mutex_unlock(&plock);
    return h;
}

/* Keep h parked when the limit allows: 1; else 0 (the caller releases it). */
static int park(CUhandle h, size_t size, int device) {
    int kept = 0;
    pthread_mutex_lock(&plock);
    if (parked_bytes + size <= park_limit) {
        if (n_parked == cap_parked) {
            size_t cap = cap_parked ? 2 * cap_parked : 64;
            parked_t *p = realloc(parked, cap * sizeof *p);
            if (p) { parked = p; cap_parked = cap; }
        }
        if (n_parked < cap_parked) {
            parked[n_parked++] = (parked_t){h, size, device};
            __atomic_store_n(&parked_bytes, parked_bytes + size, __ATOMIC_RELEASE);
            kept = 1;
        }
    }
    pthread_mutex_unlock(&plock);
    return kept;
}

/* Physical memory for [base, base+size) on device: a parked allocation of that size, else a
   new one; map, allow access. 0 or a CUresult. */
static int back(uint64_t base, size_t size, int device, CUhandle *handle) {
    CUhandle h = unpark(size, device);
    int reused = h != 0;
    if (!reused) {
        alloc_prop_t prop;
        fill_prop(&prop, device);
        int err = p_create(&h, size, &prop, 0);
        if (err == 2 /* CUDA_ERROR_OUT_OF_MEMORY */ && __atomic_load_n(&parked_bytes, __ATOMIC_RELAXED)) {
            gpuos_alloc_trim_parked(0); /* parked memory of other sizes makes room */
            err = p_create(&h, size, &prop, 0);
        }
        if (err) return note_error(err);
    }
    int err = p_map(base, size, 0, h, 0);
    if (err) { p_release(h); return note_error(err); }
    access_desc_t desc = {{1, device}, 3};
    err = p_set_access(base, size, &desc, 1);
    if (err) { p_unmap(base, size); p_release(h); return note_error(err); }
    __atomic_add_fetch(&stats[S_MAPPED], size, __ATOMIC_RELAXED);
    __atomic_add_fetch(&pstats[reused ? P_REUSES : P_CREATES], 1, __ATOMIC_RELAXED);
    *handle = h;
    return 0;
}

/* Unmap [base, base+size) and release its physical memory, or park it (may_park, within the limit). */
static int unback_park(uint64_t base, size_t size, CUhandle handle, int device, int may_park) {
    int err = p_unmap(base, size);
    if (err) return note_error(err);
    __atomic_sub_fetch(&stats[S_MAPPED], size, __ATOMIC_RELAXED);
    if (may_park && park(handle, size, device)) {
        __atomic_add_fetch(&pstats[P_PARKS], 1, __ATOMIC_RELAXED);
        return 0;
    }
    return note_error(p_release(handle));
}

static int unback(uint64_t base, size_t size, CUhandle handle) { return unback_park(base, size, handle, 0, 0); }

/* A new range of size bytes (a multiple of the granule), reserved and backed. 0 or a CUresult. */
static int new_range(size_t size, size_t align, int device, uint64_t *base, CUhandle *handle) {
    CUdeviceptr va = 0;
    int err = p_reserve(&va, size, align, 0, 0);
    if (err) return note_error(err);
    err = back(va, size, device, handle);
    if (err) { p_addr_free(va, size); return err; }
    __atomic_add_fetch(&stats[S_RESERVED], size, __ATOMIC_RELAXED);
    *base = va;
    return 0;
}

/* Give a whole record back to the driver (no lock held; the record is out of the table).
   Like cudaFree, it waits for the device first (sync): work still in flight may use the memory;
   a caller that has synchronised already passes 0. */
static void destroy_sync(const entry_t *e, int sync) {
    if (sync) p_ctx_sync();
    if (e->r.flags & F_RESIDENT) unback(e->r.base, e->r.size, e->r.handle);
    note_error(p_addr_free(e->r.base, e->r.size));
    __atomic_sub_fetch(&stats[S_RESERVED], e->r.size, __ATOMIC_RELAXED);
    free(e->bitmap);
}

static void destroy(const entry_t *e) { destroy_sync(e, 1); }

/* ---- public: setup */

/* Resolve the driver's entry points from libcuda (or the library at path, for tests).
   0 when ready; -1 dlopen failed, -2 a symbol is missing. Idempotent. */
int gpuos_alloc_init(const char *libcuda_path) {
    if (p_map) return 0;
    void *cuda = dlopen(libcuda_path ? libcuda_path : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) return -1;
    granularity_t g = (granularity_t)dlsym(cuda, "cuMemGetAllocationGranularity");
    p_reserve = (reserve_t)dlsym(cuda, "cuMemAddressReserve");
    p_addr_free = (addr_free_t)dlsym(cuda, "cuMemAddressFree");
    p_create = (create_t)dlsym(cuda, "cuMemCreate");
    p_release = (release_t)dlsym(cuda, "cuMemRelease");
    p_unmap = (unmap_t)dlsym(cuda, "cuMemUnmap");
    p_set_access = (set_access_t)dlsym(cuda, "cuMemSetAccess");
    p_ctx_sync = (ctx_sync_t)dlsym(cuda, "cuCtxSynchronize");
    p_event_create = (event_create_t)dlsym(cuda, "cuEventCreate");
    p_event_record = (event_record_t)dlsym(cuda, "cuEventRecord");
    p_event_query = (event_query_t)dlsym(cuda, "cuEventQuery");
    p_event_destroy = (event_destroy_t)dlsym(cuda, "cuEventDestroy_v2");
    map_t m = (map_t)dlsym(cuda, "cuMemMap");
    if (!g || !p_reserve || !p_addr_free || !p_create || !p_release || !p_unmap || !p_set_access ||
        !p_ctx_sync || !p_event_create || !p_event_record || !p_event_query || !p_event_destroy || !m)
        return -2;
    p_granularity = g;
    __atomic_store_n(&p_map, m, __ATOMIC_RELEASE);
    return 0;
}

/* ---- public: allocation */

static uint64_t malloc_large(size_t size, int device, size_t g) {
    size_t rounded = (size + g - 1) / g * g;
    entry_t e = {0};
    CUhandle h;
    if (new_range(rounded, g, device, &e.r.base, &h)) return 0;
    e.r.size = rounded;
    e.r.handle = h;
    e.r.requested = size;
    e.r.device = device;
    e.r.flags = F_RESIDENT;
    e.r.live = 1;
    pthread_mutex_lock(&lock);
    int err = insert(&e);
    pthread_mutex_unlock(&lock);
    if (err) { destroy(&e); return 0; }
    return e.r.base;
}

/* take a free block of a segment (lock held); 0 when it is full */
static uint64_t take_block(entry_t *e) {
    for (uint32_t w = 0; w * 64 < e->nblocks; w++) {
        uint64_t bits = e->bitmap[w];
        if (bits == ~0ull) continue;
        uint32_t bit = (uint32_t)__builtin_ctzll(~bits);
        uint32_t i = w * 64 + bit;
        if (i >= e->nblocks) return 0;
        e->bitmap[w] |= 1ull << bit;
        e->r.live++;
        e->r.requested += e->r.block;
        return e->r.base + (uint64_t)i * e->r.block;
    }
    return 0;
}

static uint64_t malloc_small(size_t size, int device, size_t g) {
    unsigned shift = SMALL_MIN_SHIFT;
    while (((size_t)1 << shift) < size) shift++;
    uint32_t block = 1u << shift;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < n_entries; i++) {
        entry_t *e = &table[i];
        if (e->r.block == block && e->r.device == device && (e->r.flags & (F_RESIDENT | F_BUSY)) == F_RESIDENT &&
            e->r.live < e->nblocks) {
            uint64_t p = take_block(e);
            pthread_mutex_unlock(&lock);
            return p;
        }
    }
    pthread_mutex_unlock(&lock);
    /* no room: a new segment, made without the lock */
    entry_t e = {0};
    e.nblocks = (uint32_t)(g / block);
    e.bitmap = calloc((e.nblocks + 63) / 64, 8);
    if (!e.bitmap) return 0;
    CUhandle h;
    if (new_range(g, g, device, &e.r.base, &h)) { free(e.bitmap); return 0; }
    e.r.size = g;
    e.r.handle = h;
    e.r.device = device;
    e.r.flags = F_RESIDENT | F_SMALL;
    e.r.block = block;
    pthread_mutex_lock(&lock);
    uint64_t p = take_block(&e);
    int err = insert(&e);
    pthread_mutex_unlock(&lock);
    if (err) { destroy(&e); return 0; }
    return p;
}

/* Device memory of at least size bytes on device; 0 when the driver refuses (out of memory). */
uint64_t gpuos_alloc_malloc(size_t size, int device) {
    if (!p_map || size == 0) return 0;
    size_t g = granularity(device);
    if (!g) return 0;
    __atomic_add_fetch(&stats[S_MALLOC], 1, __ATOMIC_RELAXED);
    if (size <= ((size_t)1 << SMALL_MAX_SHIFT) && size <= g / 2) return malloc_small(size, device, g);
    return malloc_large(size, device, g);
}

/* Free what gpuos_alloc_malloc returned (sync: wait for the device before a range goes back). */
static int free_sync(uint64_t ptr, int sync) {
    if (!ptr) return 0;
    __atomic_add_fetch(&stats[S_FREE], 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&lock);
    ssize_t i = find(ptr);
    if (i < 0) { pthread_mutex_unlock(&lock); return -EINVAL; }
    entry_t *e = &table[i];
    if (e->r.flags & F_SMALL) {
        uint64_t k = (ptr - e->r.base) / e->r.block;
        if ((ptr - e->r.base) % e->r.block || !(e->bitmap[k / 64] >> (k % 64) & 1)) {
            pthread_mutex_unlock(&lock);
            return -EINVAL;
        }
        e->bitmap[k / 64] &= ~(1ull << (k % 64));
        e->r.live--;
        e->r.requested -= e->r.block;
        /* an empty segment stays, cached for the next small request of its class */
        pthread_mutex_unlock(&lock);
        return 0;
    }
    if (ptr != e->r.base) { pthread_mutex_unlock(&lock); return -EINVAL; }
    if (e->r.flags & F_BUSY) { /* released or made resident right now: that thread frees it */
        e->r.flags |= F_FREE_PENDING;
        pthread_mutex_unlock(&lock);
        return 0;
    }
    entry_t gone = *e;
    erase((size_t)i);
    pthread_mutex_unlock(&lock);
    destroy_sync(&gone, sync);
    return 0;
}

/* Free what gpuos_alloc_malloc returned. 0, or -EINVAL for an address we did not hand out. */
int gpuos_alloc_free(uint64_t ptr) { return free_sync(ptr, 1); }

/* Give empty small segments back to the driver; returns how many. */
int gpuos_alloc_trim(void) {
    int n = 0;
    for (;;) {
        entry_t gone;
        int found = 0;
        pthread_mutex_lock(&lock);
        for (size_t i = 0; i < n_entries; i++) {
            if ((table[i].r.flags & F_SMALL) && table[i].r.live == 0 && !(table[i].r.flags & F_BUSY)) {
                gone = table[i];
                erase(i);
                found = 1;
                break;
            }
        }
        pthread_mutex_unlock(&lock);
        if (!found) return n;
        destroy(&gone);
        n++;
    }
}

/* ---- public: residency */

/* Mark the record holding addr busy and copy it out (lock taken here). 0, -ENOENT, -EBUSY, or
   -EALREADY when it is already in the state wanted (resident == want_resident). */
static int claim(uint64_t addr, int want_resident, entry_t *out) {
    pthread_mutex_lock(&lock);
    ssize_t i = find(addr);
    int rc = 0;
    if (i < 0) rc = -ENOENT;
    else if (table[i].r.flags & F_BUSY) rc = -EBUSY;
    else if (!!(table[i].r.flags & F_RESIDENT) == want_resident) rc = -EALREADY;
    else {
        table[i].r.flags |= F_BUSY;
        *out = table[i];
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Clear busy and set the outcome; carry out a free that came meanwhile. */
static void settle(uint64_t base, int resident, CUhandle handle) {
    pthread_mutex_lock(&lock);
    ssize_t i = find(base);
    entry_t *e = &table[i]; /* busy records are never erased by others */
    e->r.flags &= ~(uint32_t)F_BUSY;
    if (resident) { e->r.flags |= F_RESIDENT; e->r.handle = handle; }
    else { e->r.flags &= ~(uint32_t)F_RESIDENT; e->r.handle = 0; }
    if (e->r.flags & F_FREE_PENDING) {
        entry_t gone = *e;
        erase((size_t)i);
        pthread_mutex_unlock(&lock);
        destroy(&gone);
        return;
    }
    pthread_mutex_unlock(&lock);
}

/* Unmap and release the physical memory of the record holding addr, keeping its addresses.
   The caller has saved what it needs and no work in flight touches the range.
   0; -ENOENT not ours; -EBUSY another residency operation on it runs; -EALREADY already
   released; or the driver's CUresult, > 0 (the record then stays resident). */
int gpuos_alloc_release(uint64_t addr) {
    entry_t e;
    int rc = claim(addr, 0, &e);
    if (rc) return rc;
    rc = unback_park(e.r.base, e.r.size, e.r.handle, e.r.device, 1);
    settle(e.r.base, rc != 0, rc ? e.r.handle : 0);
    if (!rc) __atomic_add_fetch(&stats[S_RELEASES], 1, __ATOMIC_RELAXED);
    return rc;
}

/* Create physical memory for the record holding addr again and map it at the same addresses.
   Its contents are undefined until loaded. Same codes as gpuos_alloc_release. */
int gpuos_alloc_make_resident(uint64_t addr) {
    entry_t e;
    int rc = claim(addr, 1, &e);
    if (rc) return rc;
    CUhandle h = 0;
    rc = back(e.r.base, e.r.size, e.r.device, &h);
    settle(e.r.base, rc == 0, h);
    if (!rc) __atomic_add_fetch(&stats[S_RESIDENTS], 1, __ATOMIC_RELAXED);
    return rc;
}

/* Park released records' physical memory up to bytes (0: off, the default); parked memory
   beyond a lowered limit is released. Returns the bytes parked afterwards. */
uint64_t gpuos_alloc_set_park_limit(uint64_t bytes) {
    pthread_mutex_lock(&plock);
    park_limit = bytes;
    pthread_mutex_unlock(&plock);
    return gpuos_alloc_trim_parked(bytes);
}

/* Release parked memory until at most keep bytes stay parked (the most recently parked kept).
   Returns the bytes parked afterwards. */
uint64_t gpuos_alloc_trim_parked(uint64_t keep) {
    for (;;) {
        parked_t gone;
        pthread_mutex_lock(&plock);
        if (parked_bytes <= keep || n_parked == 0) {
            uint64_t left = parked_bytes;
            pthread_mutex_unlock(&plock);
            return left;
        }
        gone = parked[0]; /* the oldest */
        memmove(&parked[0], &parked[1], (n_parked - 1) * sizeof *parked);
        n_parked--;
        __atomic_store_n(&parked_bytes, parked_bytes - gone.size, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&plock);
        note_error(p_release(gone.h));
        __atomic_add_fetch(&pstats[P_DROPPED], 1, __ATOMIC_RELAXED);
    }
}

/* Bytes parked of exactly size on device (0 with none). */
uint64_t gpuos_alloc_parked(uint64_t size, int device) {
    uint64_t n = 0;
    pthread_mutex_lock(&plock);
    for (size_t i = 0; i < n_parked; i++)
        if (parked[i].size == size && parked[i].device == device) n += size;
    pthread_mutex_unlock(&plock);
    return n;
}

/* Bytes parked now: one word, read without the park lock (the scheduler reads it after every
   decision; a read racing a park or a trim sees the value before or after it). */
uint64_t gpuos_alloc_parked_total(void) { return __atomic_load_n(&parked_bytes, __ATOMIC_ACQUIRE); }

/* parked bytes, the limit, parks, reuses, parked allocations released, new physical allocations made */
void gpuos_alloc_park_stats(uint64_t out[6]) {
    pthread_mutex_lock(&plock);
    out[0] = parked_bytes;
    out[1] = park_limit;
    pthread_mutex_unlock(&plock);
    for (int i = 0; i < 4; i++) out[2 + i] = __atomic_load_n(&pstats[i], __ATOMIC_RELAXED);
}

/* ---- public: reading the table */

size_t gpuos_alloc_record_size(void) { return sizeof(gpuos_alloc_record_t); }

/* Copy up to cap records (by address) into out; returns how many there are in all. */
size_t gpuos_alloc_table(gpuos_alloc_record_t *out, size_t cap) {
    pthread_mutex_lock(&lock);
    size_t n = n_entries;
    for (size_t i = 0; i < n && i < cap; i++) out[i] = table[i].r;
    pthread_mutex_unlock(&lock);
    return n;
}

/* The record holding addr into *out; 0 or -ENOENT. */
int gpuos_alloc_lookup(uint64_t addr, gpuos_alloc_record_t *out) {
    pthread_mutex_lock(&lock);
    ssize_t i = find(addr);
    if (i >= 0) *out = table[i].r;
    pthread_mutex_unlock(&lock);
    return i < 0 ? -ENOENT : 0;
}

/* counters: mallocs, frees, bytes reserved, bytes mapped, releases, make-residents, driver
   errors, the last driver error */
void gpuos_alloc_stats(uint64_t out[8]) {
    for (int i = 0; i < 7; i++) out[i] = __atomic_load_n(&stats[i], __ATOMIC_RELAXED);
    out[S_LAST_ERROR] = (uint64_t)last_error;
}

/* ---- framework entry points */

void *gpuos_cupy_malloc(void *param, size_t size, int device) {
    (void)param;
    return (void *)(uintptr_t)gpuos_alloc_malloc(size, device);
}

void gpuos_cupy_free(void *param, void *ptr, int device) {
    (void)param;
    (void)device;
    gpuos_alloc_free((uint64_t)(uintptr_t)ptr);
}

/* ---- PyTorch: a stream-ordered cache in front of the library
 *
 * A pluggable allocator replaces torch's caching allocator, so the caching is here. torch hands
 * free() the stream the block was allocated on (its "allocation stream"), as its own allocator
 * assumes: a program that uses a block on another stream synchronises that stream with the
 * allocation stream before the free (record_stream is not available to pluggable allocators).
 *
 * - Sizes are rounded to a class: up to 1 MiB a power of two (a block of the library's
 *   segments); above, to a quarter of the power of two below the size (at most 25 % over),
 *   then to the granule. A freed block waits in its class's bucket and is handed out again
 *   only for that class: what is wasted is bounded by the rounding.
 * - A freed block is reused at once by a request on the same stream (stream order makes it
 *   safe, as in torch's allocator): the one at the lowest address of the class, so that block
 *   identity repeats with the program's allocation sequence (cache_take). A request on another stream takes it only once an event
 *   recorded on the block's stream after its free has completed; the event is recorded
 *   lazily, on the first such request (recording later covers the free too), so a free costs
 *   no driver call and a program of one stream records none.
 * - No free synchronises the device: cached blocks stay mapped (and owned: suspend saves and
 *   releases them like live ones). gpuos_torch_trim() waits for the device once and gives
 *   every cached block back; a malloc the driver refuses trims and tries again.
 */
#define CROSS_TRIES 4 /* blocks of other streams whose events one request checks */

typedef struct { uint64_t ptr; CUstream stream; CUevent event; } cblock_t;
typedef struct { uint64_t size; int device; cblock_t *v; size_t n, cap; } bucket_t;

static pthread_mutex_t tlock = PTHREAD_MUTEX_INITIALIZER; /* guards the buckets; no driver call under it */
static bucket_t *buckets; /* sorted by (device, size) */
static size_t n_buckets, cap_buckets;
static CUevent *spare_events; /* created, free for reuse */
static size_t n_spare, cap_spare;
static uint64_t tstats[8];
enum { T_HITS, T_CROSS_HITS, T_MISSES, T_CACHED_BYTES, T_CACHED_BLOCKS, T_TRIMMED, T_OOM_RETRIES, T_EVENTS };
/* torch's memory statistics per device (torch.cuda.memory_allocated and the like, which a
   pluggable allocator does not answer): bytes of live blocks (by their class), of blocks held
   from the driver (live and cached), their peaks, the allocations and frees, and the bytes
   allocated and freed in all */
#define TORCH_DEVICES 64
enum { M_ALLOCATED, M_ALLOCATED_PEAK, M_RESERVED, M_RESERVED_PEAK, M_ALLOCS, M_FREES, M_BYTES_IN, M_BYTES_OUT, M_N };
static uint64_t tmem[TORCH_DEVICES][M_N]; /* guarded by tlock */

static void mem_moved(int device, int64_t allocated, int64_t reserved) { /* tlock held */
    if (device < 0 || device >= TORCH_DEVICES) return;
    uint64_t *m = tmem[device];
    m[M_ALLOCATED] += (uint64_t)allocated;
    m[M_RESERVED] += (uint64_t)reserved;
    if (allocated > 0) m[M_ALLOCS]++, m[M_BYTES_IN] += (uint64_t)allocated;
    if (allocated < 0) m[M_FREES]++, m[M_BYTES_OUT] += (uint64_t)-allocated;
    if (m[M_ALLOCATED] > m[M_ALLOCATED_PEAK]) m[M_ALLOCATED_PEAK] = m[M_ALLOCATED];
    if (m[M_RESERVED] > m[M_RESERVED_PEAK]) m[M_RESERVED_PEAK] = m[M_RESERVED];
}

/* the class a request of size bytes is served from */
size_t gpuos_torch_round(size_t size, size_t g) { return gpuos_size_class(size, g); }

/* the bucket of (device, size); created when make (tlock held); NULL when absent or no memory */
static bucket_t *bucket(int device, uint64_t size, int make) {
    size_t lo = 0, hi = n_buckets;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        bucket_t *b = &buckets[mid];
        if (b->device < device || (b->device == device && b->size < size)) lo = mid + 1; else hi = mid;
    }
    if (lo < n_buckets && buckets[lo].device == device && buckets[lo].size == size) return &buckets[lo];
    if (!make) return NULL;
    if (n_buckets == cap_buckets) {
        size_t cap = cap_buckets ? cap_buckets * 2 : 64;
        bucket_t *t = realloc(buckets, cap * sizeof *t);
        if (!t) return NULL;
        buckets = t;
        cap_buckets = cap;
    }
    memmove(&buckets[lo + 1], &buckets[lo], (n_buckets - lo) * sizeof *buckets);
    buckets[lo] = (bucket_t){size, device, NULL, 0, 0};
    n_buckets++;
    return &buckets[lo];
}

static int push(bucket_t *b, cblock_t c) {
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 16;
        cblock_t *t = realloc(b->v, cap * sizeof *t);
        if (!t) return -ENOMEM;
        b->v = t;
        b->cap = cap;
    }
    b->v[b->n++] = c;
    return 0;
}

static void take(bucket_t *b, size_t i) {
    memmove(&b->v[i], &b->v[i + 1], (b->n - i - 1) * sizeof *b->v);
    b->n--;
    tstats[T_CACHED_BYTES] -= b->size;
    tstats[T_CACHED_BLOCKS]--;
}

static void spare(CUevent ev) { /* tlock held; an event no block needs any more */
    if (!ev) return;
    if (n_spare == cap_spare) {
        size_t cap = cap_spare ? cap_spare * 2 : 64;
        CUevent *t = realloc(spare_events, cap * sizeof *t);
        if (!t) return; /* leaks one event, harmless */
        spare_events = t;
        cap_spare = cap;
    }
    spare_events[n_spare++] = ev;
}

/* A cached block of the class for stream, or 0. */
static uint64_t cache_take(int device, size_t size, CUstream stream) {
    pthread_mutex_lock(&tlock);
    bucket_t *b = bucket(device, size, 0);
    if (!b || !b->n) { pthread_mutex_unlock(&tlock); return 0; }
    /* The lowest address of this stream's blocks, not the newest: a program that repeats its
       allocations and frees (a training step) then gets the same blocks for the same tensors
       every step whatever order it freed them in, so the records its launches touch repeat
       and gpu-prefetch-sched learns their period (with last-in first-out they did not). */
    size_t best = b->n;
    for (size_t i = 0; i < b->n; i++)
        if (b->v[i].stream == stream && (best == b->n || b->v[i].ptr < b->v[best].ptr)) best = i;
    if (best < b->n) {
        cblock_t c = b->v[best];
        take(b, best);
        spare(c.event);
        tstats[T_HITS]++;
        pthread_mutex_unlock(&tlock);
        return c.ptr;
    }
    /* others' blocks, the oldest first: out of the bucket while their events are looked at */
    cblock_t cand[CROSS_TRIES];
    CUevent fresh[CROSS_TRIES];
    size_t k = 0;
    while (k < CROSS_TRIES && b->n) {
        cand[k] = b->v[0];
        fresh[k] = NULL;
        if (!cand[k].event && n_spare) fresh[k] = spare_events[--n_spare];
        take(b, 0);
        k++;
    }
    pthread_mutex_unlock(&tlock);
    size_t won = k;
    for (size_t j = 0; j < k; j++) {
        cblock_t *c = &cand[j];
        if (!c->event) {
            CUevent ev = fresh[j];
            if (!ev && p_event_create(&ev, 2 /* CU_EVENT_DISABLE_TIMING */)) ev = NULL;
            if (ev && note_error(p_event_record(ev, c->stream))) { p_event_destroy(ev); ev = NULL; }
            if (ev) __atomic_add_fetch(&tstats[T_EVENTS], 1, __ATOMIC_RELAXED);
            c->event = ev; /* NULL: its stream is gone or refused; only a trim frees it */
        }
        if (won == k && c->event && p_event_query(c->event) == 0) won = j;
    }
    pthread_mutex_lock(&tlock);
    b = bucket(device, size, 1);
    for (size_t j = 0; j < k; j++) {
        if (j == won) continue;
        if (!b || push(b, cand[j])) { /* no memory for the table: wait and hand it back */
            pthread_mutex_unlock(&tlock);
            free_sync(cand[j].ptr, 1);
            if (cand[j].event) p_event_destroy(cand[j].event);
            pthread_mutex_lock(&tlock);
            b = bucket(device, size, 1);
            continue;
        }
        tstats[T_CACHED_BYTES] += size;
        tstats[T_CACHED_BLOCKS]++;
    }
    uint64_t p = 0;
    if (won < k) {
        p = cand[won].ptr;
        spare(cand[won].event);
        tstats[T_CROSS_HITS]++;
    }
    pthread_mutex_unlock(&tlock);
    return p;
}

/* Give every cached block back to the driver after one wait for the device; how many. */
int gpuos_torch_trim(void) {
    pthread_mutex_lock(&tlock);
    size_t n = 0;
    for (size_t i = 0; i < n_buckets; i++) n += buckets[i].n;
    cblock_t *all = n ? malloc(n * sizeof *all) : NULL;
    if (n && !all) { pthread_mutex_unlock(&tlock); return -ENOMEM; }
    size_t k = 0;
    for (size_t i = 0; i < n_buckets; i++) {
        memcpy(&all[k], buckets[i].v, buckets[i].n * sizeof *all);
        k += buckets[i].n;
        mem_moved(buckets[i].device, 0, -(int64_t)(buckets[i].size * buckets[i].n));
        buckets[i].n = 0;
    }
    tstats[T_CACHED_BYTES] = 0;
    tstats[T_CACHED_BLOCKS] = 0;
    tstats[T_TRIMMED] += n;
    CUevent *evs = spare_events;
    size_t n_evs = n_spare;
    spare_events = NULL;
    n_spare = cap_spare = 0;
    pthread_mutex_unlock(&tlock);
    if (n) p_ctx_sync(); /* work in flight on them ends first, once for all */
    for (size_t i = 0; i < n; i++) {
        free_sync(all[i].ptr, 0);
        if (all[i].event) p_event_destroy(all[i].event);
    }
    for (size_t i = 0; i < n_evs; i++) p_event_destroy(evs[i]);
    free(evs);
    free(all);
    gpuos_alloc_trim(); /* segments left empty */
    return (int)n;
}

/* counters: hits (same stream), cross-stream hits, misses (new memory), cached bytes, cached
   blocks, blocks trimmed, out-of-memory retries, events recorded */
void gpuos_torch_stats(uint64_t out[8]) {
    pthread_mutex_lock(&tlock);
    memcpy(out, tstats, sizeof tstats);
    pthread_mutex_unlock(&tlock);
}

/* torch's statistics for device: allocated, peak allocated, reserved, peak reserved bytes,
   allocations, frees, bytes allocated and freed in all (zero for a device out of range) */
void gpuos_torch_memory(int device, uint64_t out[M_N]) {
    pthread_mutex_lock(&tlock);
    if (device >= 0 && device < TORCH_DEVICES) memcpy(out, tmem[device], sizeof tmem[device]);
    else memset(out, 0, sizeof tmem[0]);
    pthread_mutex_unlock(&tlock);
}

/* torch.cuda.reset_peak_memory_stats: the peaks start again from what is held now */
void gpuos_torch_reset_peaks(int device) {
    pthread_mutex_lock(&tlock);
    if (device >= 0 && device < TORCH_DEVICES) {
        tmem[device][M_ALLOCATED_PEAK] = tmem[device][M_ALLOCATED];
        tmem[device][M_RESERVED_PEAK] = tmem[device][M_RESERVED];
    }
    pthread_mutex_unlock(&tlock);
}

/* Whether the contents of the record at base are dead: every block of it the library handed to
   torch is in torch's cache, freed by the program, so whatever the record holds no tensor will
   read before writing it (a freshly allocated tensor's contents are undefined). 1: dead, 0: a
   block is live (or the record is not torch's: CuPy's pool and direct callers keep their free
   blocks out of sight), -ENOENT: no record starts at base. A moment's answer: a malloc may take
   a block right after; its new tensor's contents are undefined all the same. */
int gpuos_torch_dead(uint64_t base) {
    gpuos_alloc_record_t r;
    if (gpuos_alloc_lookup(base, &r) || r.base != base) return -ENOENT;
    int small = (r.flags & F_SMALL) != 0;
    uint64_t block = small ? r.block : r.size;
    uint64_t live = small ? r.live : 1;
    if (!live) return 1;
    uint64_t n = 0;
    pthread_mutex_lock(&tlock);
    bucket_t *b = bucket(r.device, block, 0);
    if (b)
        for (size_t i = 0; i < b->n && n < live; i++) n += b->v[i].ptr >= base && b->v[i].ptr - base < r.size;
    pthread_mutex_unlock(&tlock);
    return n >= live;
}

/* torch.cuda.memory.CUDAPluggableAllocator's signatures (gpuos_alloc_init first: owned.py). */
void *gpuos_torch_malloc(ssize_t size, int device, void *stream) {
    if (size <= 0 || !p_map) return NULL;
    size_t g = granularity(device);
    if (!g) return NULL;
    size_t r = gpuos_torch_round((size_t)size, g);
    uint64_t p = cache_take(device, r, stream);
    if (p) {
        pthread_mutex_lock(&tlock);
        mem_moved(device, (int64_t)r, 0);
        pthread_mutex_unlock(&tlock);
        return (void *)(uintptr_t)p;
    }
    p = gpuos_alloc_malloc(r, device);
    if (!p && gpuos_torch_trim() > 0) { /* the driver refused: give the cache back, once more */
        __atomic_add_fetch(&tstats[T_OOM_RETRIES], 1, __ATOMIC_RELAXED);
        p = gpuos_alloc_malloc(r, device);
    }
    if (p) {
        __atomic_add_fetch(&tstats[T_MISSES], 1, __ATOMIC_RELAXED);
        pthread_mutex_lock(&tlock);
        mem_moved(device, (int64_t)r, (int64_t)r);
        pthread_mutex_unlock(&tlock);
    }
    return (void *)(uintptr_t)p;
}

void gpuos_torch_free(void *ptr, ssize_t size, int device, void *stream) {
    if (!ptr) return;
    size_t g = granularity(device);
    size_t r = g && size > 0 ? gpuos_torch_round((size_t)size, g) : 0;
    pthread_mutex_lock(&tlock);
    bucket_t *b = r ? bucket(device, r, 1) : NULL;
    if (b && !push(b, (cblock_t){(uint64_t)(uintptr_t)ptr, stream, NULL})) {
        tstats[T_CACHED_BYTES] += r;
        tstats[T_CACHED_BLOCKS]++;
        mem_moved(device, -(int64_t)r, 0);
        pthread_mutex_unlock(&tlock);
        return;
    }
    mem_moved(device, -(int64_t)r, -(int64_t)r);
    pthread_mutex_unlock(&tlock);
    gpuos_alloc_free((uint64_t)(uintptr_t)ptr); /* no room to cache it: back to the driver */
}
