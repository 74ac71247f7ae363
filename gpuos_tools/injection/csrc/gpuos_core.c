/*
 * gpuos native core: the agent's per-operation work in C, in the program's own thread.
 * (One unit, over 800 lines: its tables share one lock and are static to it, so that the compiler
 * sees every access on the per-operation path; split, they would need exported globals.)
 *
 * The tracer's CUPTI callback (gpuos_trace.c built with -DGPUOS_AGENT) hands every launch, copy,
 * memset, free and graph launch of the program to core_enter() before the driver sees it, and
 * every allocation, free, copy and memset to the core_after_*() functions once it succeeded. The
 * core keeps what the agent needs on every operation -- the live allocations, each launch's
 * memoised access set, what was written since the last snapshot, what a snapshot in progress has
 * not yet copied, what was touched when -- and enters Python (upcall_t, one ctypes callback) only
 * when something must happen: a launch whose access set is not memoised, a snapshot buffer to
 * protect, the residency engine or the scheduler with work to do, a reference dump. The design,
 * and why each rule keeps the Python agent's semantics, is in docs/native-core.md.
 *
 * Everything below is guarded by the core lock, which is also the agent's lock on the Python
 * side (gpuos_tools/injection/core.py NativeLock), except the own-thread table, the issuing
 * count (its own mutex) and the stream set touched by resource callbacks (its own mutex).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gpuos_core.h"

/* ---- flags Python sets (core.py F_*) */
enum { F_ENGINE = 1, F_EXEC = 2, F_GATE = 4, F_TOUCH = 8, F_SKIP_CAPTURED = 16, F_FAST = 32 };
static volatile uint32_t flags;
static upcall_fn upcall;

/* ---- the lock; a program thread that holds the GIL lets it go while it waits (a Python thread
   of the agent may hold the lock and need the GIL to finish) */
static pthread_mutex_t core_mu;
static pthread_once_t core_once = PTHREAD_ONCE_INIT;
static int (*p_gil_check)(void);
static void *(*p_save_thread)(void);
static void (*p_restore_thread)(void *);

static void init_lock(void) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&core_mu, &a);
    p_gil_check = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    p_save_thread = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
    p_restore_thread = (void (*)(void *))dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
    if (!p_gil_check || !p_save_thread || !p_restore_thread) p_gil_check = NULL;
}

void core_lock_program(void) {
    pthread_once(&core_once, init_lock);
    if (pthread_mutex_trylock(&core_mu) == 0) return;
    void *ts = NULL;
    if (p_gil_check && p_gil_check()) ts = p_save_thread();
    pthread_mutex_lock(&core_mu);
    if (ts) p_restore_thread(ts);
}

void core_unlock(void) { pthread_mutex_unlock(&core_mu); }

/* From Python (ctypes lets the GIL go around the call). */
void core_lock_py(void) {
    pthread_once(&core_once, init_lock);
    pthread_mutex_lock(&core_mu);
}

int core_trylock_py(double timeout_s) {
    pthread_once(&core_once, init_lock);
    if (timeout_s == 0) return pthread_mutex_trylock(&core_mu) == 0;
    if (timeout_s < 0) { pthread_mutex_lock(&core_mu); return 1; }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = ts.tv_nsec + (long long)(timeout_s * 1e9);
    ts.tv_sec += ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    return pthread_mutex_timedlock(&core_mu, &ts) == 0;
}

/* ---- counters (core_counters) */
static uint64_t n_ops, n_enters, n_upcalls, ns_enter, ns_upcall, n_misses, n_hits, n_protects, epoch = 1;
/* why the epoch moved: allocations, frees, host bytes holding live pointers, writes over stored
   pointers, module unloads, Python (a kernel made conservative) */
static uint64_t bumps[6];
static uint64_t coll_gen; /* the collectives cache's generation (below) */
enum { B_ALLOC, B_FREE, B_WORDS, B_OVER, B_MODULE, B_PYTHON };

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int call_up(upcall_t *u) {
    if (!upcall) return -1;
    uint64_t t = now_ns();
    int rc = upcall(u);
    n_upcalls++;
    ns_upcall += now_ns() - t;
    return rc;
}

/* ---- the agent's own threads: their driver calls are not the program's */
#define OWN_MAX 512
static int own_tids[OWN_MAX];
static int n_own;
static pthread_mutex_t own_mu = PTHREAD_MUTEX_INITIALIZER;
static capture_query_fn capture_query; /* set by the front end at its start */

void core_set_capture_query(capture_query_fn query) { capture_query = query; }

static __thread int my_tid;

static inline int tid_now(void) {
    if (!my_tid) my_tid = (int)syscall(SYS_gettid);
    return my_tid;
}

int core_skip(void) {
    int n = __atomic_load_n(&n_own, __ATOMIC_ACQUIRE);
    if (!n) return 0;
    int me = tid_now();
    for (int i = 0; i < n && i < OWN_MAX; i++)
        if (__atomic_load_n(&own_tids[i], __ATOMIC_RELAXED) == me) return 1;
    return 0;
}

/* Add (on) or remove a thread id; 0 when the table is full. */
int core_own(int tid, int on) {
    pthread_mutex_lock(&own_mu);
    int i, n = n_own, found = -1;
    for (i = 0; i < n; i++)
        if (own_tids[i] == tid) found = i;
    int ok = 1;
    if (on && found < 0) {
        int slot = -1;
        for (i = 0; i < n; i++)
            if (own_tids[i] == 0) slot = i;
        if (slot >= 0) __atomic_store_n(&own_tids[slot], tid, __ATOMIC_RELEASE);
        else if (n < OWN_MAX) {
            __atomic_store_n(&own_tids[n], tid, __ATOMIC_RELEASE);
            __atomic_store_n(&n_own, n + 1, __ATOMIC_RELEASE);
        } else ok = 0;
    } else if (!on && found >= 0) {
        __atomic_store_n(&own_tids[found], 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&own_mu);
    return ok;
}

/* ---- operations being issued: past their enter, not yet at their exit */
static pthread_mutex_t issued_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t issued_cv = PTHREAD_COND_INITIALIZER;
static int issuing;

void core_issued(void) {
    pthread_mutex_lock(&issued_mu);
    if (issuing > 0) issuing--;
    if (issuing == 0) pthread_cond_broadcast(&issued_cv);
    pthread_mutex_unlock(&issued_mu);
}

/* Wait until at most `own` operations are being issued; those left after timeout_s. */
int core_settle(double timeout_s, int own) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = ts.tv_nsec + (long long)(timeout_s * 1e9);
    ts.tv_sec += ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    pthread_mutex_lock(&issued_mu);
    while (issuing > own)
        if (pthread_cond_timedwait(&issued_cv, &issued_mu, &ts) == ETIMEDOUT) break;
    int left = issuing > own ? issuing - own : 0;
    pthread_mutex_unlock(&issued_mu);
    return left;
}

/* ---- streams the program used (operations) or created (resource callbacks). Snapshots order
   after every one of them; an eviction only after those an operation of the program used (a
   stream only created holds none of its work: the agent's own streams, a library's idle ones). */
static uint64_t *streams;
static uint8_t *streams_used; /* per entry of streams: an operation used it */
static int n_streams, cap_streams;
static unsigned stream_gen; /* bumped at every destroy: a thread's cached last stream may be gone */
static pthread_mutex_t streams_mu = PTHREAD_MUTEX_INITIALIZER;

static void stream_set(uint64_t s, int add, int used) {
    pthread_mutex_lock(&streams_mu);
    int i;
    for (i = 0; i < n_streams && streams[i] != s; i++) {}
    if (add && i == n_streams) {
        if (n_streams == cap_streams) {
            int cap = cap_streams ? 2 * cap_streams : 64;
            uint64_t *p = realloc(streams, (size_t)cap * 8);
            if (p) streams = p;
            uint8_t *u = p ? realloc(streams_used, (size_t)cap) : NULL;
            if (u) { streams_used = u; cap_streams = cap; }
        }
        if (n_streams < cap_streams) {
            streams[n_streams] = s;
            streams_used[n_streams++] = (uint8_t)used;
        }
    } else if (add && used) {
        streams_used[i] = 1;
    } else if (!add && i < n_streams) {
        n_streams--;
        streams[i] = streams[n_streams];
        streams_used[i] = streams_used[n_streams];
        __atomic_add_fetch(&stream_gen, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&streams_mu);
}

/* The last stream an operation used, per thread: most operations repeat it (no table walk). */
static __thread uint64_t last_stream = ~0ull;
static __thread unsigned last_gen;

static inline void stream_used(uint64_t s) {
    unsigned gen = __atomic_load_n(&stream_gen, __ATOMIC_ACQUIRE);
    if (s == last_stream && gen == last_gen) return;
    last_stream = s;
    last_gen = gen;
    stream_set(s, 1, 1);
}

void core_stream_event(uint64_t s, int destroyed) {
    stream_set(s, !destroyed, 0);
}

static int copy_streams(uint64_t *out, int cap, int used_only) {
    pthread_mutex_lock(&streams_mu);
    int n = 0;
    for (int i = 0; i < n_streams; i++) {
        if (used_only && !streams_used[i]) continue;
        if (n < cap) out[n] = streams[i];
        n++;
    }
    pthread_mutex_unlock(&streams_mu);
    return n;
}

/* The streams the program used or created: up to cap into out; returns how many there are. */
int core_streams(uint64_t *out, int cap) { return copy_streams(out, cap, 0); }

/* The streams an operation of the program used (same contract). */
int core_used_streams(uint64_t *out, int cap) { return copy_streams(out, cap, 1); }

/* ---- live allocations, sorted by address, with the predictor's rules (model/allocs.py) */
typedef struct {
    uint64_t start, end, id;
    uint64_t first_touch, last_touch;
    /* bytes copied from the host landed in [pay_lo, pay_hi): the predictor keeps them; those of
       them that held a word inside the hull (or all of them, once the hull grew) in [ptr_lo, ptr_hi) */
    uint64_t pay_lo, pay_hi, ptr_lo, ptr_hi;
    uint32_t snap;    /* index in the snapshot in progress + 1; 0: not in it */
    uint8_t dirty;    /* written since the last snapshot's T0 */
    uint8_t pad[3];
    /* the fast path: nothing for the executor or the engine to do on an operation that writes
       it while `ready` equals ready_gen, on one that only reads it while `readable` does
       (Python marks them; 0: not). With `stream_only`, only an operation on `only_stream`
       (its effective handle) may: the mark of a record still loading, set after that stream
       was made to wait for the load */
    uint32_t ready, readable;
    uint64_t only_stream;
    uint8_t stream_only;
} alloc_t;
static alloc_t *allocs;
static size_t n_allocs, cap_allocs;
/* the fast path (below): an allocation came or went since Python last allowed operations */
static int fast_moved = 1;
static uint32_t ready_gen = 1; /* moved: every mark is gone at once (from any thread) */
static uint64_t hull_lo = ~0ull, hull_hi, next_id = 1, touch_seq;
static int dirty_all = 1; /* what was written is not known (no snapshot yet, or unknown since) */

static size_t upper(uint64_t addr) { /* first index whose start > addr */
    size_t lo = 0, hi = n_allocs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (allocs[mid].start <= addr) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static alloc_t *find(uint64_t addr) {
    if (!addr || addr < hull_lo || addr >= hull_hi) return NULL;
    size_t i = upper(addr);
    if (!i) return NULL;
    alloc_t *a = &allocs[i - 1];
    return addr < a->end ? a : NULL;
}

/* ---- the view queue: what Python's copy of the predictor must see, in order */
enum { V_ALLOC = 1, V_FREE = 2, V_COPY = 3, V_SET = 4 };
static char *vbuf;
static size_t vlen, vcap;

/* room for `need` more bytes in a queue buffer that doubles from 64 KiB: 0, or -1 (no memory) */
static int grow(char **buf, size_t len, size_t *cap, size_t need) {
    if (len + need <= *cap) return 0;
    size_t c = *cap ? *cap : 65536;
    while (c < len + need) c *= 2;
    char *b = realloc(*buf, c);
    if (!b) return -1;
    *buf = b;
    *cap = c;
    return 0;
}

static char *vput(uint32_t tag, size_t body) {
    size_t need = 8 + ((body + 7) & ~(size_t)7);
    if (grow(&vbuf, vlen, &vcap, need)) return NULL;
    char *p = vbuf + vlen;
    uint32_t h[2] = {tag, (uint32_t)need};
    memcpy(p, h, 8);
    memset(p + 8, 0, need - 8);
    vlen += need;
    return p + 8;
}

/* Hand the queue to Python (core lock held): the caller frees it with core_free. */
char *core_view_take(size_t *len) {
    char *b = vbuf;
    *len = vlen;
    vbuf = NULL;
    vlen = vcap = 0;
    return b;
}

void core_free(void *p) { free(p); }

static void evict_at(size_t i) {
    memmove(&allocs[i], &allocs[i + 1], (n_allocs - i - 1) * sizeof(alloc_t));
    n_allocs--;
}

void core_after_alloc(uint64_t addr, uint64_t size, uint32_t kind) {
    uint64_t end = addr + size;
    size_t i = upper(addr);
    /* an allocation overlapping live ones replaces them (their free was not seen) */
    if (i > 0 && allocs[i - 1].end > addr) evict_at(--i);
    while (i < n_allocs && (allocs[i].start < end || allocs[i].start == addr)) evict_at(i);
    if (n_allocs == cap_allocs) {
        size_t cap = cap_allocs ? 2 * cap_allocs : 1024;
        alloc_t *p = realloc(allocs, cap * sizeof(alloc_t));
        if (!p) return;
        allocs = p;
        cap_allocs = cap;
    }
    memmove(&allocs[i + 1], &allocs[i], (n_allocs - i) * sizeof(alloc_t));
    n_allocs++;
    alloc_t *a = &allocs[i];
    memset(a, 0, sizeof *a);
    a->start = addr;
    a->end = end;
    a->id = next_id++;
    a->dirty = 1;
    int grew = addr < hull_lo || end > hull_hi;
    if (addr < hull_lo) hull_lo = addr;
    if (end > hull_hi) hull_hi = end;
    if (grew) /* a word of stored bytes that was outside the hull may point into it now */
        for (size_t k = 0; k < n_allocs; k++)
            if (allocs[k].pay_hi) {
                alloc_t *b = &allocs[k];
                if (!b->ptr_hi || b->pay_lo < b->ptr_lo) b->ptr_lo = b->pay_lo;
                if (b->pay_hi > b->ptr_hi) b->ptr_hi = b->pay_hi;
            }
    epoch++;
    bumps[B_ALLOC]++;
    fast_moved = 1;
    uint64_t *v = (uint64_t *)vput(V_ALLOC, 32);
    if (v) { v[0] = a->id; v[1] = addr; v[2] = size; v[3] = kind; }
}

void core_after_free(uint64_t addr) {
    if (!addr) return;
    uint64_t *v = (uint64_t *)vput(V_FREE, 8);
    if (v) v[0] = addr;
    size_t i = upper(addr);
    if (i && allocs[i - 1].start == addr) {
        evict_at(i - 1);
        epoch++;
        bumps[B_FREE]++;
        fast_moved = 1;
    }
}


/* 1: a word inside the hull; 2: one inside a live allocation (a pointer the predictor follows) */
static int hull_words(const uint8_t *p, uint64_t n) {
    int got = 0;
    for (uint64_t off = 0; off + 8 <= n; off += 8) {
        uint64_t w;
        memcpy(&w, p + off, 8);
        if (w >= hull_lo && w < hull_hi) {
            got = 1;
            if (find(w)) return 2;
        }
    }
    return got;
}

/* A copy (with the host bytes it carried, if any) or a memset wrote [dst, dst + n). The
   predictor's memo moves when a stored pointer may change: new bytes holding a live pointer, or a
   write over stored bytes that held a word inside the hull. */
void core_after_write(uint64_t dst, const uint8_t *payload, uint64_t n, uint64_t stream, int is_set) {
    (void)stream;
    alloc_t *a = find(dst);
    int words = payload ? hull_words(payload, n) : 0;
    uint64_t end = dst + n;
    if (words == 2) {
        epoch++;
        bumps[B_WORDS]++;
    } else if (a && a->ptr_hi && dst < a->ptr_hi && end > a->ptr_lo) {
        epoch++;
        bumps[B_OVER]++;
    }
    if (a && payload) {
        if (!a->pay_hi || dst < a->pay_lo) a->pay_lo = dst;
        if (end > a->pay_hi) a->pay_hi = end;
        if (words) {
            if (!a->ptr_hi || dst < a->ptr_lo) a->ptr_lo = dst;
            if (end > a->ptr_hi) a->ptr_hi = end;
        }
    }
    if (payload || (a && a->pay_hi && dst < a->pay_hi && end > a->pay_lo)) { /* its stored contents change */
        uint64_t plen = payload ? n : 0;
        char *p = vput(is_set ? V_SET : V_COPY, 24 + plen);
        if (p) {
            uint64_t h[3] = {dst, n, plen};
            memcpy(p, h, 24);
            if (plen) memcpy(p + 24, payload, plen);
        }
    }
}

void core_module_unloading(void) {
    __atomic_add_fetch(&epoch, 1, __ATOMIC_RELAXED); /* function handles may come back for others */
    __atomic_add_fetch(&coll_gen, 1, __ATOMIC_RELEASE);
    bumps[B_MODULE]++;
}

void core_bump_epoch(void) { /* any thread */
    __atomic_add_fetch(&epoch, 1, __ATOMIC_RELAXED);
    bumps[B_PYTHON]++;
}

/* the program's context: the agent's threads make it current (the first one a call ran in) */
static uint64_t first_ctx;

void core_saw_context(uint64_t ctx) {
    uint64_t none = 0;
    if (ctx) __atomic_compare_exchange_n(&first_ctx, &none, ctx, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

uint64_t core_context(void) { return __atomic_load_n(&first_ctx, __ATOMIC_ACQUIRE); }

size_t core_view_len(void) { return vlen; }

/* ---- memoised access sets, per (function, the argument words inside the hull) and epoch */
typedef struct memo {
    struct memo *next;
    uint64_t func, hash, epoch;
    uint32_t nfound, nw, nt;
    int32_t unknown;
    uint64_t *found; /* nfound x (param << 32 | word), value */
    uint32_t *idx;   /* nw + nt allocation indexes (valid for this epoch) */
} memo_t;
#define MEMO_BUCKETS 16384
#define MEMO_MAX 65536
static memo_t *memo[MEMO_BUCKETS];
static size_t n_memo;
static uint64_t memo_epoch;

static void memo_clear(void) {
    for (size_t b = 0; b < MEMO_BUCKETS; b++) {
        for (memo_t *m = memo[b], *nx; m; m = nx) {
            nx = m->next;
            free(m->found);
            free(m->idx);
            free(m);
        }
        memo[b] = NULL;
    }
    n_memo = 0;
}

/* scratch for the argument scan (core lock held; copied into the memo entry before any upcall) */
#define FOUND_MAX 8192
static uint64_t found_buf[2 * FOUND_MAX];
#define IDS_CAP 16384

static inline uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

/* the words of the arguments inside the hull, as gpu-predict-access's pointer key takes them */
static uint32_t scan(const uint32_t *sizes, uint32_t np, const uint8_t *args, uint64_t *hash, int *overflow) {
    uint32_t n = 0, pos = 0;
    uint64_t h = 0x12345;
    *overflow = 0;
    for (uint32_t i = 0; i < np; i++) {
        uint32_t s = sizes[i];
        for (uint32_t j = 0; j + 8 <= s; j += 8) {
            uint64_t w;
            memcpy(&w, args + pos + j, 8);
            if (w >= hull_lo && w < hull_hi) {
                if (n == FOUND_MAX) { *overflow = 1; return n; }
                found_buf[2 * n] = (uint64_t)i << 32 | (j >> 3);
                found_buf[2 * n + 1] = w;
                h = mix(mix(h, found_buf[2 * n]), w);
                n++;
            }
        }
        pos += s;
    }
    *hash = h;
    return n;
}

/* The scanned words as the memo keys them (and their hash): a range prediction's allocation
   set depends on which allocation each word points into, not where in it (each pointer reads
   and writes from itself to its allocation's end), except where the word points into bytes
   copied from the host, whose stored pointers the predictor follows from there on: then the
   word itself counts. So a launch whose pointers moved within their allocations (a decode's growing
   cache, a tensor the caching allocator placed elsewhere in the same segment) hits. */
#define KEY_IN 0x8000000000000000ull /* (KEY_IN | id): somewhere in allocation id */
#define KEY_NONE 0xffffffffffffffffull /* in no allocation */
static uint64_t coarse(uint32_t n) {
    uint64_t h = 0x12345;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t w = found_buf[2 * k + 1];
        alloc_t *a = find(w);
        if (!a) w = KEY_NONE;
        else if (w < a->pay_lo || w >= a->pay_hi) w = KEY_IN | a->id;
        found_buf[2 * k + 1] = w;
        h = mix(mix(h, found_buf[2 * k]), w);
    }
    return h;
}

/* id -> index of the live allocations, for storing Python's answer (built once per epoch) */
static uint64_t (*by_id)[2];
static size_t n_by_id;
static uint64_t by_id_epoch;

static int cmp_id(const void *a, const void *b) {
    uint64_t x = ((const uint64_t *)a)[0], y = ((const uint64_t *)b)[0];
    return x < y ? -1 : x > y;
}

static long index_of_id(uint64_t id) {
    if (by_id_epoch != epoch || !by_id) {
        free(by_id);
        by_id = malloc((n_allocs ? n_allocs : 1) * sizeof *by_id);
        if (!by_id) return -1;
        for (size_t i = 0; i < n_allocs; i++) { by_id[i][0] = allocs[i].id; by_id[i][1] = i; }
        qsort(by_id, n_allocs, sizeof *by_id, cmp_id);
        n_by_id = n_allocs;
        by_id_epoch = epoch;
    }
    size_t lo = 0, hi = n_by_id;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (by_id[mid][0] < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < n_by_id && by_id[lo][0] == id ? (long)by_id[lo][1] : -1;
}

/* The launch's access set: memoised, or predicted by Python now. NULL: not known (treated as
   unknown, touching nothing). */
static memo_t *access_of(uint32_t cbid, uint64_t stream, uint64_t raw, uint64_t func, const char *name,
                         const uint32_t *sizes, uint32_t np, const uint8_t *args, uint32_t args_len) {
    if (memo_epoch != epoch) {
        memo_clear();
        memo_epoch = epoch;
    }
    uint64_t h = 0;
    uint32_t nf = 0;
    int overflow = 0;
    int known = args_len != CORE_NO_ARGS;
    if (known) nf = scan(sizes, np, args, &h, &overflow);
    if (overflow) return NULL;
    if (nf) h = coarse(nf);
    h = mix(mix(h, func), known);
    size_t b = h % MEMO_BUCKETS;
    for (memo_t *m = memo[b]; m; m = m->next)
        if (m->hash == h && m->func == func && m->nfound == nf &&
            !memcmp(m->found, found_buf, (size_t)nf * 16)) {
            n_hits++;
            return m;
        }
    n_misses++;
    memo_t *m = calloc(1, sizeof *m);
    uint64_t *ids = malloc(IDS_CAP * 8);
    if (m) m->found = malloc((size_t)(nf ? nf : 1) * 16);
    if (!m || !ids || !m->found) {
        if (m) free(m->found);
        free(m);
        free(ids);
        return NULL;
    }
    memcpy(m->found, found_buf, (size_t)nf * 16);
    m->func = func;
    m->hash = h;
    m->nfound = nf;
    upcall_t u = {0};
    u.what = UP_PREDICT;
    u.cbid = cbid;
    u.stream = stream;
    u.raw_stream = raw;
    u.func = func;
    u.name = name;
    u.sizes = sizes;
    u.nparams = np;
    u.args = args;
    u.args_len = args_len;
    u.ids = ids;
    u.cap = IDS_CAP;
    int rc = call_up(&u);
    uint32_t n = rc == 0 && u.nw + u.nt <= u.cap ? u.nw + u.nt : 0;
    m->idx = malloc((size_t)(n ? n : 1) * 4);
    if (rc != 0 || !m->idx || memo_epoch != epoch) {
        /* failed, or allocations changed during the upcall: not known (every buffer counts) */
        free(m->found);
        free(m->idx);
        free(m);
        free(ids);
        return NULL;
    }
    if (n_memo >= MEMO_MAX) memo_clear();
    m->epoch = epoch;
    m->unknown = u.unknown || u.nw + u.nt > u.cap; /* more than fit: every buffer counts */
    for (uint32_t k = 0; k < n; k++) {
        long i = index_of_id(ids[k]);
        if (i < 0) continue; /* not live (freed meanwhile): nothing to track */
        if (k < u.nw) m->idx[m->nw++] = (uint32_t)i; /* writes first, touched after them */
        else m->idx[m->nw + m->nt++] = (uint32_t)i;
    }
    free(ids);
    b = m->hash % MEMO_BUCKETS;
    m->next = memo[b];
    memo[b] = m;
    n_memo++;
    return m;
}

/* ---- a snapshot in progress: per buffer, done, or the streams whose writes are already
   ordered after its copy (the agent's Snap.safe) */
#define SAFE_MAX 8
typedef struct { uint8_t done, nsafe; uint64_t safe[SAFE_MAX]; } sbuf_t;
static sbuf_t *sbufs;
static uint32_t n_sbufs;
static int snap_active;

/* At T0 (core lock held): the snapshot's buffers, by allocation id, in its order. */
int core_snap_begin(const uint64_t *ids, uint32_t n) {
    free(sbufs);
    sbufs = calloc(n ? n : 1, sizeof *sbufs);
    if (!sbufs) return -1;
    n_sbufs = n;
    for (size_t i = 0; i < n_allocs; i++) allocs[i].snap = 0;
    for (uint32_t k = 0; k < n; k++) {
        long i = index_of_id(ids[k]);
        if (i >= 0) allocs[i].snap = k + 1;
    }
    snap_active = 1;
    return 0;
}

void core_snap_done(uint32_t i) {
    if (i < n_sbufs) sbufs[i].done = 1;
}

void core_snap_safe(uint32_t i, const uint64_t *s, uint32_t n) {
    if (i >= n_sbufs) return;
    sbufs[i].nsafe = (uint8_t)(n < SAFE_MAX ? n : SAFE_MAX); /* more: asked again, Python knows */
    memcpy(sbufs[i].safe, s, (size_t)sbufs[i].nsafe * 8);
}

void core_snap_end(void) {
    snap_active = 0;
    for (size_t i = 0; i < n_allocs; i++) allocs[i].snap = 0;
}


static inline int needs_protect(uint32_t i, uint64_t stream) {
    sbuf_t *s = &sbufs[i];
    if (s->done) return 0;
    for (int k = 0; k < s->nsafe; k++)
        if (s->safe[k] == stream) return 0;
    return 1;
}

/* Python protects buffers `targets` (n of them, an array it may keep no reference to). */
static void protect(const uint32_t *targets, uint32_t n, uint64_t stream, uint32_t cbid) {
    if (!n) return;
    upcall_t u = {0};
    u.what = UP_PROTECT;
    u.cbid = cbid;
    u.stream = stream;
    u.ntargets = n;
    u.targets = targets;
    n_protects++;
    call_up(&u);
}

static void protect_all(uint64_t stream, uint32_t cbid) {
    uint32_t *t = malloc((size_t)(n_sbufs ? n_sbufs : 1) * 4), n = 0;
    if (!t) return;
    for (uint32_t i = 0; i < n_sbufs; i++)
        if (needs_protect(i, stream)) t[n++] = i;
    protect(t, n, stream, cbid);
    free(t);
}

static void protect_alloc(alloc_t *a, uint64_t stream, uint32_t cbid) {
    if (a && a->snap && needs_protect(a->snap - 1, stream)) {
        uint32_t t = a->snap - 1;
        protect(&t, 1, stream, cbid);
    }
}

/* ---- dirty (written since the last snapshot's T0) and touches (for the engine's orders) */

/* The live allocations written since the last call (ids into out, at most cap; all: everything
   counts, the set is not known); then a new period starts. Core lock held. */
int core_take_dirty(uint64_t *out, int cap, int *all) {
    *all = dirty_all;
    int n = 0;
    for (size_t i = 0; i < n_allocs; i++) {
        if (allocs[i].dirty && !dirty_all) {
            if (n < cap) out[n] = allocs[i].id;
            n++;
        }
        allocs[i].dirty = 0;
    }
    dirty_all = 0;
    return n;
}

void core_forget_dirty(void) { dirty_all = 1; }

static inline void touch(alloc_t *a) {
    a->last_touch = ++touch_seq;
    if (!a->first_touch) a->first_touch = a->last_touch;
}

/* (id, first touch, last touch) of each live allocation touched so far; how many there are. */
int core_touches(uint64_t *out, int cap) {
    int n = 0;
    for (size_t i = 0; i < n_allocs; i++) {
        if (!allocs[i].first_touch) continue;
        if (n < cap) {
            out[3 * n] = allocs[i].id;
            out[3 * n + 1] = allocs[i].first_touch;
            out[3 * n + 2] = allocs[i].last_touch;
        }
        n++;
    }
    return n;
}

static int capture_begun;

/* ---- collectives: NCCL's kernel launches, counted for a job's consistent cut
   (docs/multi-gpu-jobs.md). A kernel is a collective when its name (mangled or not) begins with
   ncclDevKernel_ or ncclKernel_; the answer is cached per function handle, and the cache is
   forgotten when a module is unloaded (handles come back for other kernels). */
#define COLL_SLOTS 4096
typedef struct { uint64_t func, gen; int8_t coll; } coll_slot_t;
static coll_slot_t coll_cache[COLL_SLOTS];
static uint64_t coll_gen = 1;
/* collectives launched; graph launches; collectives captured into a graph (they run when the
   graph is launched, uncounted); the collective an armed cut waits for (0: not armed) */
static uint64_t n_coll, n_graphs, n_coll_captured, arm_k;

int core_collective_name(const char *name) {
    if (!name) return 0;
    const char *p = name;
    if (p[0] == '_' && p[1] == 'Z') { /* a mangled name: _Z<length><name> */
        p += 2;
        if (*p < '0' || *p > '9') return 0;
        while (*p >= '0' && *p <= '9') p++;
    }
    return !strncmp(p, "ncclDevKernel_", 14) || !strncmp(p, "ncclKernel_", 11);
}

static int is_collective(uint64_t func, const char *name) {
    uint64_t gen = __atomic_load_n(&coll_gen, __ATOMIC_ACQUIRE);
    if (!func) return core_collective_name(name);
    size_t h = (size_t)((func * 0x9e3779b97f4a7c15ull) >> 52) % COLL_SLOTS;
    for (int probe = 0; probe < 8; probe++) {
        coll_slot_t *s = &coll_cache[(h + probe) % COLL_SLOTS];
        if (s->gen == gen && s->func == func) return s->coll;
        if (s->gen != gen) { /* free (or stale): take it */
            s->func = func;
            s->coll = (int8_t)core_collective_name(name);
            s->gen = gen;
            return s->coll;
        }
    }
    return core_collective_name(name); /* a crowded neighbourhood: not cached */
}

/* collectives, graph launches, collectives captured, the armed K (0: none), whether any stream
   began capturing a graph. */
void core_collectives(uint64_t out[5]) {
    out[0] = n_coll;
    out[1] = n_graphs;
    out[2] = n_coll_captured;
    out[3] = arm_k;
    out[4] = (uint64_t)__atomic_load_n(&capture_begun, __ATOMIC_ACQUIRE);
}

/* Arm the cut at collective k (0: disarm); core lock held. -1: the program is at or past k
   already (nothing armed). */
int core_arm(uint64_t k) {
    if (k && n_coll >= k) return -1;
    arm_k = k;
    return 0;
}

/* ---- references (tests): operation numbers at whose start the state is dumped */
static uint64_t *refs;
static uint32_t n_refs, ref_at;

void core_set_references(const uint64_t *ns, uint32_t n) {
    free(refs);
    refs = n ? malloc((size_t)n * 8) : NULL;
    n_refs = refs ? n : 0;
    if (refs) memcpy(refs, ns, (size_t)n * 8);
    ref_at = 0;
}

/* what the last launch's access set was (tests compare it with gpu-predict-access's) */
static memo_t *last_access;
static int last_known;


/* ---- the scheduler's fast path (docs/native-core.md, "The fast path").
   With F_FAST, an operation that would call the agent's hooks (F_ENGINE or F_EXEC) goes on
   without entering Python when Python has nothing to do for it: every allocation it writes is
   marked ready and every one it reads readable (owned records resident, loaded, resident in the
   policy's books, and for a write not clean; other allocations), the policy allowed more
   operations (fast_left: its plan has no action before then), no allocation came or went since,
   and its access set is known. It is queued instead (fq): Python replays the queue into the
   policy's books at its next upcall, in order, before anything else. Python clears a record's
   marks before an eviction or a load of it is enqueued, with the core lock held (or, from a
   thread that cannot take it at once, every mark: ready_gen), so an operation that touches it
   from then on takes the upcall. */
enum { FQ_LAUNCH = 1, FQ_WRITE = 2 };
static int64_t fast_left;
static uint64_t n_fast;
/* why an operation that would call the hooks did call (core_fast_counts): the allowance spent,
   an allocation came or went, the queue full, its access set unknown, a record it writes not
   ready, one it reads not readable, a write of an API that always calls; and every mark dropped
   at once (core_fast_unready_all); an allocation marked for another stream only */
enum { W_LEFT, W_MOVED, W_FULL, W_UNKNOWN, W_WRITE, W_READ, W_SLOW, W_ALL, W_STREAM, W_N };
static uint64_t why[W_N];
/* the start of the allocation whose missing mark made the last operation call (0: none since
   the last core_fast_last_unready), for Python to say why it was not marked */
static uint64_t last_unready;
static char *fq;
static size_t fq_len, fq_cap;
static uint32_t fq_entries;
#define FQ_MAX_BYTES (8u << 20)
static uint8_t slow_cbid[8192]; /* bit per cbid: its writes always go to Python (opaque copies) */

static char *fq_put(size_t body) {
    size_t need = (body + 7) & ~(size_t)7;
    if (grow(&fq, fq_len, &fq_cap, need)) return NULL;
    char *p = fq + fq_len;
    memset(p, 0, need);
    fq_len += need;
    fq_entries++;
    return p;
}

/* Python: the next `left` decisions need no call (core lock held); an allocation change since
   is forgotten (Python has read the records). */
void core_fast_allow(int64_t left) {
    fast_left = left;
    fast_moved = 0;
}

/* Mark the allocations holding each of addrs: level 2, an operation may read and write it
   without a call; 1, only read it (a record whose host copy is current: a write must reach the
   engine); 0, neither. */
void core_fast_mark(const uint64_t *addrs, uint32_t n, int level) {
    uint32_t g = __atomic_load_n(&ready_gen, __ATOMIC_ACQUIRE);
    for (uint32_t k = 0; k < n; k++) {
        alloc_t *a = find(addrs[k]);
        if (a) {
            a->ready = level >= 2 ? g : 0;
            a->readable = level >= 1 ? g : 0;
            a->stream_only = 0;
        }
    }
}

/* The same for operations on `stream` alone (its effective handle: 2 for the per-thread default
   stream): a record whose load that stream was made to wait for, still in flight (core lock held). */
void core_fast_mark_on(const uint64_t *addrs, uint32_t n, int level, uint64_t stream) {
    uint32_t g = __atomic_load_n(&ready_gen, __ATOMIC_ACQUIRE);
    for (uint32_t k = 0; k < n; k++) {
        alloc_t *a = find(addrs[k]);
        if (a) {
            a->ready = level >= 2 ? g : 0;
            a->readable = level >= 1 ? g : 0;
            a->only_stream = stream;
            a->stream_only = 1;
        }
    }
}

static inline int wrong_stream(const alloc_t *a, uint64_t stream) {
    if (a->stream_only && a->only_stream != stream) {
        why[W_STREAM]++;
        return 1;
    }
    return 0;
}

/* Every mark is gone (any thread, no lock needed). */
void core_fast_unready_all(void) {
    __atomic_add_fetch(&why[W_ALL], 1, __ATOMIC_RELAXED);
    uint32_t g = __atomic_add_fetch(&ready_gen, 1, __ATOMIC_ACQ_REL);
    if (!g) __atomic_add_fetch(&ready_gen, 1, __ATOMIC_ACQ_REL); /* 0 means "not ready" */
}

/* Every allocation that overlaps [base, base + size) is not ready (a record's state changes).
   From any thread: with the core lock held or free, those allocations alone; while another
   thread holds it (the table may be changing), every mark. */
void core_fast_unready(uint64_t base, uint64_t size) {
    pthread_once(&core_once, init_lock);
    if (pthread_mutex_trylock(&core_mu) != 0) {
        core_fast_unready_all();
        return;
    }
    uint64_t end = base + (size ? size : 1);
    size_t i = upper(base);
    if (i) i--;
    for (; i < n_allocs && allocs[i].start < end; i++)
        if (allocs[i].end > base) allocs[i].ready = allocs[i].readable = 0;
    pthread_mutex_unlock(&core_mu);
}

/* How many of the n ranges [bases[k], bases[k] + sizes[k]) no live allocation of the core holds
   whole (owned records the core did not see mapped: the fast path cannot mark them). */
uint32_t core_fast_uncovered(const uint64_t *bases, const uint64_t *sizes, uint32_t n) {
    uint32_t missing = 0;
    for (uint32_t k = 0; k < n; k++) {
        alloc_t *a = find(bases[k]);
        if (!a || a->end < bases[k] + sizes[k]) missing++;
    }
    return missing;
}

void core_fast_slow_cbid(uint32_t cbid) {
    if (cbid < sizeof slow_cbid * 8) slow_cbid[cbid >> 3] |= (uint8_t)(1u << (cbid & 7));
}

/* The queue of operations that went without a call, handed to Python (core lock held; the
   caller frees it with core_free): per entry u32 kind, u32 bytes, u64 operation number, u32
   cbid, u32 name length, u64 stream, then a launch's u32 writes, u32 touched, the ids, the name;
   a write's u64 dst, src. */
char *core_fast_take(size_t *len, uint32_t *entries) {
    char *b = fq;
    *len = fq_len;
    *entries = fq_entries;
    fq = NULL;
    fq_len = fq_cap = 0;
    fq_entries = 0;
    return b;
}

static inline int fast_allowed(void) {
    return (flags & F_FAST) && fast_left > 0 && !fast_moved && fq_len < FQ_MAX_BYTES;
}

static void fq_header(char *p, uint32_t kind, uint32_t bytes, uint32_t cbid, uint32_t nlen, uint64_t stream) {
    uint32_t h[2] = {kind, bytes};
    memcpy(p, h, 8);
    memcpy(p + 8, &n_ops, 8);
    uint32_t c[2] = {cbid, nlen};
    memcpy(p + 16, c, 8);
    memcpy(p + 24, &stream, 8);
}

/* A launch with memo entry m goes on without a call: 1 (queued), 0 (Python must see it). */
static int fast_launch(memo_t *m, uint32_t cbid, uint64_t stream, const char *name) {
    if (!fast_allowed()) return 0;
    if (!m || m->unknown) {
        why[W_UNKNOWN]++;
        return 0;
    }
    uint32_t n = m->nw + m->nt, g = __atomic_load_n(&ready_gen, __ATOMIC_ACQUIRE);
    for (uint32_t k = 0; k < m->nw; k++) /* written */
        if (allocs[m->idx[k]].ready != g) {
            why[W_WRITE]++;
            last_unready = allocs[m->idx[k]].start;
            return 0;
        }
    for (uint32_t k = m->nw; k < n; k++) /* touched (the written ones again: checked above) */
        if (allocs[m->idx[k]].readable != g) {
            why[W_READ]++;
            last_unready = allocs[m->idx[k]].start;
            return 0;
        }
    for (uint32_t k = 0; k < n; k++)
        if (wrong_stream(&allocs[m->idx[k]], stream)) return 0;
    size_t nlen = name ? strnlen(name, 4096) : 0;
    size_t bytes = 40 + (size_t)n * 8 + nlen;
    char *p = fq_put(bytes);
    if (!p) return 0;
    fq_header(p, FQ_LAUNCH, (uint32_t)((bytes + 7) & ~(size_t)7), cbid, (uint32_t)nlen, stream);
    uint32_t c[2] = {m->nw, m->nt};
    memcpy(p + 32, c, 8);
    for (uint32_t k = 0; k < n; k++) memcpy(p + 40 + 8 * k, &allocs[m->idx[k]].id, 8);
    if (nlen) memcpy(p + 40 + (size_t)n * 8, name, nlen);
    fast_left--;
    n_fast++;
    return 1;
}

/* A copy or memset (dst, src: 0 when none) without a call: as fast_launch. A free is no
   decision of the policy: it goes on when what it frees is ready (or is not device memory). */
static int fast_write(uint32_t op, uint32_t cbid, uint64_t stream, uint64_t dst, uint64_t src) {
    if (!fast_allowed()) return 0;
    if (cbid < sizeof slow_cbid * 8 && (slow_cbid[cbid >> 3] >> (cbid & 7) & 1)) {
        why[W_SLOW]++;
        return 0;
    }
    alloc_t *d = find(dst), *s = find(src);
    uint32_t g = __atomic_load_n(&ready_gen, __ATOMIC_ACQUIRE);
    if (d && d->ready != g) {
        why[W_WRITE]++;
        last_unready = d->start;
        return 0;
    }
    if (s && s->readable != g) {
        why[W_READ]++;
        last_unready = s->start;
        return 0;
    }
    if ((d && wrong_stream(d, stream)) || (s && wrong_stream(s, stream))) return 0;
    if (op == OP_FREE) {
        n_fast++;
        return 1;
    }
    char *p = fq_put(48);
    if (!p) return 0;
    fq_header(p, FQ_WRITE, 48, cbid, 0, stream);
    memcpy(p + 32, &dst, 8);
    memcpy(p + 40, &src, 8);
    fast_left--;
    n_fast++;
    return 1;
}

/* operations let go, allowance left, entries queued, then why[] */
void core_fast_counts(uint64_t out[3 + W_N]) {
    out[0] = n_fast;
    out[1] = (uint64_t)(fast_left > 0 ? fast_left : 0);
    out[2] = fq_entries;
    for (int k = 0; k < W_N; k++) out[3 + k] = __atomic_load_n(&why[k], __ATOMIC_RELAXED);
}

/* the allocation whose missing mark made the last call (its start; 0: none), then forgotten
   (core lock held) */
uint64_t core_fast_last_unready(void) {
    uint64_t a = last_unready;
    last_unready = 0;
    return a;
}

/* ---- the enter site */

void core_capture_begun(void) { __atomic_store_n(&capture_begun, 1, __ATOMIC_RELEASE); }

void core_enter(uint32_t op, uint32_t cbid, int ptsz, int gated, uint64_t stream, uint64_t func,
                const char *name, const uint32_t *sizes, uint32_t np, const uint8_t *args,
                uint32_t args_len, uint64_t dst, uint64_t src, int capturing) {
    uint64_t t0 = now_ns();
    uint64_t eff = stream == 0 && ptsz ? 2 : stream; /* CU_STREAM_PER_THREAD */
    (void)capturing;
    if (gated && (flags & F_GATE)) { /* serve: the GPU turn first, before the lock */
        upcall_t g = {0};
        g.what = UP_GATE;
        g.cbid = cbid;
        g.stream = eff;
        call_up(&g);
    }
    core_lock_program();
    pthread_mutex_lock(&issued_mu);
    issuing++;
    pthread_mutex_unlock(&issued_mu);
    n_enters++;
    int coll = op == OP_LAUNCH && is_collective(func, name);
    if (coll && __atomic_load_n(&capture_begun, __ATOMIC_ACQUIRE) && capture_query && capture_query(stream)) {
        n_coll_captured++; /* it runs when its graph is launched: a graph of unknown collectives */
        coll = 0;
    }
    if (op != OP_GRAPH && (snap_active || (flags & F_SKIP_CAPTURED)) &&
        __atomic_load_n(&capture_begun, __ATOMIC_ACQUIRE) && (op == OP_LAUNCH || stream) &&
        capture_query && capture_query(stream)) {
        n_ops++; /* only recorded into a graph: it writes nothing now */
        goto out;
    }
    if (op == OP_GRAPH) {
        n_graphs++;
        stream_used(stream); /* its kernels run there: an eviction must order after them */
    }
    if (coll && ++n_coll == arm_k) { /* the cut: T0 before this launch, on this thread */
        arm_k = 0;
        upcall_t c = {0};
        c.what = UP_CUT;
        c.cbid = cbid;
        c.stream = eff;
        c.raw_stream = stream;
        c.func = func;
        c.name = name;
        c.n = n_coll;
        call_up(&c);
    }
    if (op != OP_GRAPH) {
        n_ops++;
        stream_used(stream);
        while (ref_at < n_refs && refs[ref_at] < n_ops) ref_at++;
        if (ref_at < n_refs && refs[ref_at] == n_ops) {
            upcall_t r = {0};
            r.what = UP_REFERENCE;
            r.n = n_ops;
            call_up(&r);
        }
    }
    memo_t *pre = NULL; /* the fast path looks the launch's access set up before the hook */
    uint64_t pre_epoch = 0;
    int fast = 0;
    if ((flags & (F_ENGINE | F_EXEC)) && (flags & F_FAST) && !fast_allowed() && op != OP_GRAPH)
        why[fast_left <= 0 ? W_LEFT : fast_moved ? W_MOVED : W_FULL]++;
    if ((flags & (F_ENGINE | F_EXEC)) && fast_allowed()) {
        if (op == OP_LAUNCH) {
            pre = access_of(cbid, eff, stream, func, name, sizes, np, args, args_len);
            pre_epoch = epoch;
            fast = pre && fast_launch(pre, cbid, eff, name);
        } else if (op == OP_WRITE || op == OP_FREE) {
            fast = fast_write(op, cbid, eff, dst, src);
        }
    }
    if ((flags & (F_ENGINE | F_EXEC)) && !fast) { /* the engine or the scheduler has work: the agent's hook */
        upcall_t u = {0};
        uint64_t *given = NULL;
        if (op == OP_LAUNCH) {
            /* the hook's prediction is the memo's: looked up (or predicted, once) here and handed
               over, so that Python does not predict the launch again */
            if (!pre || pre_epoch != epoch) {
                pre = access_of(cbid, eff, stream, func, name, sizes, np, args, args_len);
                pre_epoch = epoch;
            }
            if (pre && (given = malloc(((size_t)pre->nw + pre->nt + 1) * 8))) {
                for (uint32_t k = 0; k < pre->nw + pre->nt; k++) given[k] = allocs[pre->idx[k]].id;
                u.ids = given;
                u.nw = pre->nw;
                u.nt = pre->nt;
                u.unknown = pre->unknown;
            }
        }
        u.what = op == OP_LAUNCH ? UP_LAUNCH : op == OP_GRAPH ? UP_GRAPH : UP_WRITE;
        u.cbid = cbid;
        u.stream = eff;
        u.raw_stream = stream;
        u.func = func;
        u.name = name;
        u.sizes = sizes;
        u.nparams = np;
        u.args = args;
        u.args_len = args_len;
        u.dst = dst;
        u.src = src;
        call_up(&u);
        free(given);
    }
    last_known = 0;
    if (op == OP_LAUNCH) {
        if (!snap_active && dirty_all) {
            /* only touches are wanted (the engine's orders): the allocations its argument words
               point into, without a prediction (no upcall, however often the memo moves) */
            if ((flags & F_TOUCH) && args_len != CORE_NO_ARGS) {
                uint64_t h;
                int overflow;
                uint32_t nf = scan(sizes, np, args, &h, &overflow);
                for (uint32_t k = 0; k < nf; k++) {
                    alloc_t *a = find(found_buf[2 * k + 1]);
                    if (a) touch(a);
                }
            }
            goto out;
        }
        /* the fast path's lookup stands unless the hook moved the epoch (its entry is gone then) */
        memo_t *m = pre && pre_epoch == epoch ? pre : access_of(cbid, eff, stream, func, name, sizes, np, args, args_len);
        last_access = m;
        last_known = 1;
        int unknown = !m || m->unknown;
        if (m) {
            if (flags & F_TOUCH) /* the touched part includes the writes */
                for (uint32_t k = m->nw; k < m->nw + m->nt; k++) touch(&allocs[m->idx[k]]);
            if (!dirty_all && !unknown)
                for (uint32_t k = 0; k < m->nw; k++) allocs[m->idx[k]].dirty = 1;
        }
        if (unknown) dirty_all = 1;
        if (snap_active) {
            if (unknown) protect_all(eff, cbid);
            else if (m->nw) {
                uint32_t *t = malloc((size_t)m->nw * 4), n = 0;
                if (t) {
                    for (uint32_t k = 0; k < m->nw; k++) {
                        alloc_t *a = &allocs[m->idx[k]];
                        if (a->snap && needs_protect(a->snap - 1, eff)) t[n++] = a->snap - 1;
                    }
                    protect(t, n, eff, cbid);
                    free(t);
                } else protect_all(eff, cbid);
            }
        }
    } else if (op == OP_WRITE || op == OP_FREE) {
        alloc_t *a = find(dst);
        if (a) a->dirty = 1;
        if ((flags & F_TOUCH) && op == OP_WRITE) {
            if (a) touch(a);
            alloc_t *s = find(src);
            if (s) touch(s);
        }
        if (snap_active) protect_alloc(a, eff, cbid);
    } else if (op == OP_GRAPH) { /* what its kernels write is not predicted here */
        dirty_all = 1;
        if (snap_active) protect_all(eff, cbid);
    }
out:
    ns_enter += now_ns() - t0;
    core_unlock();
}


/* unknown (-1: no access set was looked up), then writes and touched ids into out (cap). */
int core_last_access(uint64_t *out, uint32_t cap, uint32_t *nw, uint32_t *nt) {
    *nw = *nt = 0;
    if (!last_known) return -1;
    memo_t *m = last_access;
    if (!m) return 1;
    if (m->nw + m->nt > cap) return -2;
    for (uint32_t k = 0; k < m->nw + m->nt; k++) out[k] = allocs[m->idx[k]].id;
    *nw = m->nw;
    *nt = m->nt;
    return m->unknown;
}

/* ---- set up and figures */
void core_set_flags(uint32_t mask, uint32_t values) {
    uint32_t f = flags;
    flags = (f & ~mask) | (values & mask);
}

uint32_t core_flags(void) { return flags; }

void core_set_upcall(upcall_fn fn) {
    pthread_once(&core_once, init_lock);
    upcall = fn;
}

/* operations, enters, upcalls, ns in enters, ns in upcalls, memo misses, memo hits, protect
   upcalls, epoch, live allocations, memo entries, whether the GIL is let go while waiting, the
   epoch's moves by cause (bumps), then the operations the fast path let go without a call */
void core_counters(uint64_t out[19]) {
    uint64_t v[19] = {n_ops, n_enters, n_upcalls, ns_enter, ns_upcall, n_misses, n_hits, n_protects,
                      epoch, n_allocs, n_memo, p_gil_check != NULL,
                      bumps[B_ALLOC], bumps[B_FREE], bumps[B_WORDS], bumps[B_OVER], bumps[B_MODULE], bumps[B_PYTHON],
                      n_fast};
    memcpy(out, v, sizeof v);
}

uint64_t core_ops(void) { return n_ops; }
