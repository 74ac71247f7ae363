/*
 * A stand-in for libcuda's virtual memory API, for the CPU tests of gpuos_alloc.c: address
 * ranges come from a counter, physical handles are numbers, and every call checks what the
 * driver checks (maps inside a reservation, no double map, unmap of exactly a mapping, release
 * of a live handle), counting what is live so that the tests can see leaks.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GRANULE (2u << 20)
#define MAXN 65536
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2 };

typedef struct { uint64_t base, size; int used; } range_t;
typedef struct { uint64_t base, size, handle; int used; } mapping_t;

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static range_t ranges[MAXN];
static mapping_t maps[MAXN];
static uint64_t next_va = 0x7f0000000000ull, next_handle = 1;
static int64_t live_handles, mapped_bytes, reserved_bytes, syncs;
static int64_t physical_limit = -1; /* bytes of physical memory allowed; -1 unlimited */
static int64_t physical_used;
static uint64_t handle_size[MAXN];

int cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)prop; (void)option;
    *g = GRANULE;
    return OK;
}

int cuMemAddressReserve(uint64_t *ptr, size_t size, size_t align, uint64_t addr, unsigned long long flags) {
    (void)addr; (void)flags;
    if (size % GRANULE || (align && align % GRANULE)) return INVALID_VALUE;
    pthread_mutex_lock(&m);
    for (int i = 0; i < MAXN; i++) {
        if (!ranges[i].used) {
            ranges[i] = (range_t){next_va, size, 1};
            *ptr = next_va;
            next_va += size + GRANULE; /* a gap, so that overruns find nothing */
            reserved_bytes += (int64_t)size;
            pthread_mutex_unlock(&m);
            return OK;
        }
    }
    pthread_mutex_unlock(&m);
    return OUT_OF_MEMORY;
}

int cuMemAddressFree(uint64_t ptr, size_t size) {
    pthread_mutex_lock(&m);
    for (int i = 0; i < MAXN; i++) {
        if (ranges[i].used && ranges[i].base == ptr && ranges[i].size == size) {
            for (int j = 0; j < MAXN; j++)
                if (maps[j].used && maps[j].base >= ptr && maps[j].base < ptr + size) {
                    pthread_mutex_unlock(&m);
                    return INVALID_VALUE; /* still mapped */
                }
            ranges[i].used = 0;
            reserved_bytes -= (int64_t)size;
            pthread_mutex_unlock(&m);
            return OK;
        }
    }
    pthread_mutex_unlock(&m);
    return INVALID_VALUE;
}

int cuMemCreate(uint64_t *handle, size_t size, const void *prop, unsigned long long flags) {
    (void)prop; (void)flags;
    if (size % GRANULE) return INVALID_VALUE;
    pthread_mutex_lock(&m);
    if (physical_limit >= 0 && physical_used + (int64_t)size > physical_limit) {
        pthread_mutex_unlock(&m);
        return OUT_OF_MEMORY;
    }
    if (next_handle >= MAXN) { pthread_mutex_unlock(&m); return OUT_OF_MEMORY; }
    *handle = next_handle;
    handle_size[next_handle++] = size;
    live_handles++;
    physical_used += (int64_t)size;
    pthread_mutex_unlock(&m);
    return OK;
}

int cuMemRelease(uint64_t handle) {
    pthread_mutex_lock(&m);
    if (handle == 0 || handle >= MAXN || !handle_size[handle]) { pthread_mutex_unlock(&m); return INVALID_VALUE; }
    physical_used -= (int64_t)handle_size[handle];
    handle_size[handle] = 0;
    live_handles--;
    pthread_mutex_unlock(&m);
    return OK;
}

int cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, unsigned long long flags) {
    (void)flags;
    pthread_mutex_lock(&m);
    int inside = 0;
    for (int i = 0; i < MAXN; i++)
        if (ranges[i].used && ptr >= ranges[i].base && ptr + size <= ranges[i].base + ranges[i].size) inside = 1;
    int bad = !inside || offset || handle >= MAXN || handle_size[handle] != size;
    for (int j = 0; j < MAXN && !bad; j++)
        if (maps[j].used && ptr < maps[j].base + maps[j].size && maps[j].base < ptr + size) bad = 1;
    if (bad) { pthread_mutex_unlock(&m); return INVALID_VALUE; }
    for (int j = 0; j < MAXN; j++)
        if (!maps[j].used) {
            maps[j] = (mapping_t){ptr, size, handle, 1};
            mapped_bytes += (int64_t)size;
            pthread_mutex_unlock(&m);
            return OK;
        }
    pthread_mutex_unlock(&m);
    return OUT_OF_MEMORY;
}

int cuMemUnmap(uint64_t ptr, size_t size) {
    pthread_mutex_lock(&m);
    for (int j = 0; j < MAXN; j++)
        if (maps[j].used && maps[j].base == ptr && maps[j].size == size) {
            maps[j].used = 0;
            mapped_bytes -= (int64_t)size;
            pthread_mutex_unlock(&m);
            return OK;
        }
    pthread_mutex_unlock(&m);
    return INVALID_VALUE;
}

int cuMemSetAccess(uint64_t ptr, size_t size, const void *desc, size_t count) {
    (void)desc;
    pthread_mutex_lock(&m);
    int found = 0;
    for (int j = 0; j < MAXN; j++)
        if (maps[j].used && maps[j].base == ptr && maps[j].size == size) found = 1;
    pthread_mutex_unlock(&m);
    return found && count == 1 ? OK : INVALID_VALUE;
}

static void all_streams_done(void);

int cuCtxSynchronize(void) {
    __atomic_add_fetch(&syncs, 1, __ATOMIC_RELAXED);
    all_streams_done(); /* what was enqueued has run */
    return OK;
}

/* for the tests: live handles, mapped bytes, reserved bytes, synchronisations */
void fake_counters(int64_t out[4]) {
    pthread_mutex_lock(&m);
    out[0] = live_handles;
    out[1] = mapped_bytes;
    out[2] = reserved_bytes;
    out[3] = syncs;
    pthread_mutex_unlock(&m);
}

void fake_set_physical_limit(int64_t bytes) {
    pthread_mutex_lock(&m);
    physical_limit = bytes;
    pthread_mutex_unlock(&m);
}

/* Events: an event records the count of "work" its stream had when recorded; it is complete
   once the test has marked the stream's work done up to that point (fake_stream_done). Streams
   are any pointer values; up to 64 distinct ones. */
#define NOT_READY 600
typedef struct { void *stream; uint64_t seq; int live; } fake_event_t;
static fake_event_t events[MAXN];
static void *stream_ids[64];
static uint64_t stream_recorded[64], stream_done[64];
static int64_t live_events, records, queries;

static int stream_slot(void *s) {
    for (int i = 0; i < 64; i++) if (stream_ids[i] == s && (s || i == 0)) return i;
    for (int i = 1; i < 64; i++) if (!stream_ids[i]) { stream_ids[i] = s; return i; }
    return -1;
}

int cuEventCreate(void **ev, unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&m);
    for (int i = 1; i < MAXN; i++)
        if (!events[i].live) {
            events[i] = (fake_event_t){0, 0, 1};
            live_events++;
            *ev = (void *)(uintptr_t)i;
            pthread_mutex_unlock(&m);
            return OK;
        }
    pthread_mutex_unlock(&m);
    return OUT_OF_MEMORY;
}

int cuEventRecord(void *ev, void *stream) {
    uintptr_t i = (uintptr_t)ev;
    pthread_mutex_lock(&m);
    int s = stream_slot(stream);
    if (i == 0 || i >= MAXN || !events[i].live || s < 0) { pthread_mutex_unlock(&m); return INVALID_VALUE; }
    events[i].stream = stream;
    events[i].seq = ++stream_recorded[s];
    records++;
    pthread_mutex_unlock(&m);
    return OK;
}

int cuEventQuery(void *ev) {
    uintptr_t i = (uintptr_t)ev;
    pthread_mutex_lock(&m);
    if (i == 0 || i >= MAXN || !events[i].live) { pthread_mutex_unlock(&m); return INVALID_VALUE; }
    queries++;
    int s = stream_slot(events[i].stream);
    int rc = events[i].seq <= stream_done[s] ? OK : NOT_READY;
    pthread_mutex_unlock(&m);
    return rc;
}

int cuEventDestroy_v2(void *ev) {
    uintptr_t i = (uintptr_t)ev;
    pthread_mutex_lock(&m);
    if (i == 0 || i >= MAXN || !events[i].live) { pthread_mutex_unlock(&m); return INVALID_VALUE; }
    events[i].live = 0;
    live_events--;
    pthread_mutex_unlock(&m);
    return OK;
}

/* for the tests: everything recorded on stream so far is complete */
void fake_stream_done(void *stream) {
    pthread_mutex_lock(&m);
    int s = stream_slot(stream);
    if (s >= 0) stream_done[s] = stream_recorded[s];
    pthread_mutex_unlock(&m);
}

/* live events, records, queries */
void fake_event_counters(int64_t out[3]) {
    pthread_mutex_lock(&m);
    out[0] = live_events;
    out[1] = records;
    out[2] = queries;
    pthread_mutex_unlock(&m);
}

static void all_streams_done(void) {
    pthread_mutex_lock(&m);
    for (int i = 0; i < 64; i++) stream_done[i] = stream_recorded[i];
    pthread_mutex_unlock(&m);
}

/* Managed memory, for the CPU tests of gpuos_um.c: cuMemAllocManaged hands out ranges from the
   same counter (global attach only), cuMemGetInfo_v2 says what fake_set_free set, and
   cuMemPrefetchAsync_v2 is recorded (the last call, and a count). */
static uint64_t fake_free_bytes = 1ull << 40;
static int64_t managed_allocs, managed_bytes, managed_prefetches;
static uint64_t last_prefetch[4]; /* ptr, size, location type, stream */

int cuMemAllocManaged(uint64_t *ptr, size_t size, unsigned flags) {
    if (flags != 1 || !size) return INVALID_VALUE;
    pthread_mutex_lock(&m);
    *ptr = next_va;
    next_va += (size + GRANULE - 1) / GRANULE * GRANULE + GRANULE;
    managed_allocs++;
    managed_bytes += (int64_t)size;
    pthread_mutex_unlock(&m);
    return OK;
}

int cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    pthread_mutex_lock(&m);
    *free_b = fake_free_bytes;
    *total_b = 2 * fake_free_bytes;
    pthread_mutex_unlock(&m);
    return OK;
}

typedef struct { int type; int id; } fake_location_t;

int cuMemPrefetchAsync_v2(uint64_t ptr, size_t size, fake_location_t loc, unsigned flags, void *stream) {
    if (flags) return INVALID_VALUE;
    pthread_mutex_lock(&m);
    managed_prefetches++;
    last_prefetch[0] = ptr;
    last_prefetch[1] = size;
    last_prefetch[2] = (uint64_t)loc.type;
    last_prefetch[3] = (uint64_t)(uintptr_t)stream;
    pthread_mutex_unlock(&m);
    return OK;
}

void fake_set_free(uint64_t bytes) {
    pthread_mutex_lock(&m);
    fake_free_bytes = bytes;
    pthread_mutex_unlock(&m);
}

/* managed allocations, their bytes, prefetches, then the last prefetch's ptr, size, location type, stream */
void fake_managed_counters(int64_t out[7]) {
    pthread_mutex_lock(&m);
    out[0] = managed_allocs;
    out[1] = managed_bytes;
    out[2] = managed_prefetches;
    for (int i = 0; i < 4; i++) out[3 + i] = (int64_t)last_prefetch[i];
    pthread_mutex_unlock(&m);
}
