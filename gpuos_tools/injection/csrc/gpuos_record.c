/*
 * The recorder behind both front ends (gpuos_record.h): the CUPTI callback of gpu-trace
 * (gpuos_trace.c) and the driver-API interposer (gpuos_intercept.c with -DGPUOS_AGENT).
 *
 * Entering Python per driver call costs microseconds, so the per-call path is C: the same
 * handlers as tracer.py, writing fixed binary records into a buffer that a thread of its own ships
 * to gpu-trace over the pipe. Record layouts are mirrored by gpuos_tools/model/binary.py
 * (parse_records), which the parent uses to decode. No CUDA header is needed: a call's arguments
 * arrive in the layout of CUPTI's parameter structs (every field used is 8 bytes, except the
 * launch dimensions), and the few driver functions used are declared below.
 *
 * Built with -DGPUOS_AGENT and linked with gpuos_core.c, the recorder is also the in-process
 * agent's front half: at each launch, copy, memset, free and graph launch's enter it hands the
 * operation to the native core (core_enter, gpuos_core.h), and after each successful allocation,
 * free, copy and memset it updates the core's allocation table.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gpuos_record.h"
#ifdef GPUOS_AGENT
#include "gpuos_core.h"
#endif

typedef int (*param_info_t)(void *, size_t, size_t *, size_t *);
typedef int (*pointer_attr_t)(void *, int, uint64_t);
typedef int (*is_capturing_t)(void *, int *);
typedef int (*name_of_t)(const char **, void *);
typedef int (*ctx_current_t)(void **);
typedef int (*func_module_t)(void **, void *);

/* ---- handler kinds (tracer.py KIND_* constants) */
enum {
    K_LAUNCH = 1, K_LAUNCH_COOP = 2, K_LAUNCH_EX = 3, K_GRAPH = 4,
    K_ALLOC = 10, /* + alloc kind: 0 device 1 pitch 2 managed 3 async 4 pool 5 host */
    K_MAP = 16,
    K_FREE = 20, K_FREE_ASYNC = 21, K_FREE_HOST = 22, K_UNMAP = 23,
    K_COPY = 32, /* | dir << 2 | peer << 1 | stream; dir 0 default 1 HtoD 2 DtoH 3 DtoD 4 peer */
    K_COPY2D = 56, K_COPY2D_ASYNC = 57,
    K_SET = 64, /* | elem code << 2 | 2d << 1 | stream; elem code 0:1 1:2 2:4 bytes */
    K_LIBRARY = 80,
    K_VARIABLE = 84, K_FUNCTION = 85, /* a module's variable or function looked up by name */
    K_CAPTURE_BEGIN = 90, K_CAPTURE_END = 91, K_INSTANTIATE = 92,
};

/* ---- record tags (parse_records in native.py) */
enum { R_LAUNCH = 1, R_FUNC = 2, R_ALLOC = 3, R_FREE = 4, R_COPY = 5, R_SET = 6, R_MODULE = 7,
       R_STREAM = 8, R_GRAPH = 9, R_LIBRARY = 12, R_GRAPHOP = 14, R_ERROR = 15, R_SYMBOL = 16 };

#define MAX_CBID 4096
#define SMALL_COPY 4096 /* bytes of a host-to-device copy kept in its record */
static uint8_t kind_of[MAX_CBID];
static uint8_t ptsz_of[MAX_CBID]; /* a _ptsz/_ptds variant: its stream 0 is the per-thread stream */
static param_info_t p_func_param_info, p_kernel_param_info;
static pointer_attr_t p_pointer_attr;
static is_capturing_t p_is_capturing;
static name_of_t p_func_name, p_kernel_name;
static ctx_current_t p_ctx_current;
static func_module_t p_func_module;
static int out_fd = -1, check_pointers, flush_us = 20000, running;
static void (*on_gone)(void);
static pthread_t writer_thread;
static pthread_mutex_t lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP; /* a driver call made while recording may call back */
static char *buf;
static size_t buf_len, buf_cap;
static uint64_t n_callbacks, n_errors, n_functions, ns_in_callbacks;

static __thread uint32_t my_tid;

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static inline uint32_t tid(void) {
    if (!my_tid) my_tid = (uint32_t)syscall(SYS_gettid);
    return my_tid;
}

/* Reserve n bytes at the end of the buffer (lock held). NULL when memory runs out. */
static char *reserve(size_t n) {
    if (buf_len + n > buf_cap) {
        size_t cap = buf_cap ? buf_cap : (1u << 20);
        while (cap < buf_len + n) cap *= 2;
        char *b = realloc(buf, cap);
        if (!b) { n_errors++; return NULL; }
        buf = b;
        buf_cap = cap;
    }
    char *p = buf + buf_len;
    buf_len += n;
    return p;
}

/* record header: u16 tag, u16 0, u32 total length (header included), u64 ts, u32 tid, u32 cbid */
typedef struct { uint16_t tag, pad; uint32_t len; uint64_t ts; uint32_t tid, cbid; } hdr_t;

static char *begin(uint16_t tag, uint32_t cbid, size_t body) {
    char *p = reserve(sizeof(hdr_t) + body);
    if (!p) return NULL;
    hdr_t h = {tag, 0, (uint32_t)(sizeof(hdr_t) + body), now_ns(), tid(), cbid};
    memcpy(p, &h, sizeof h);
    return p + sizeof h;
}

/* The kernel's name from the driver, when the front end did not give one (the interposer). */
static const char *driver_name(void *func) {
    const char *name = NULL;
    if (p_func_name && p_func_name(&name, func) == 0 && name) return name;
    if (p_kernel_name && p_kernel_name(&name, func) == 0 && name) return name;
    return NULL;
}

/* ---- parameter layouts, by function handle */
typedef struct layout {
    void *func;
    uint32_t n, known, args_len;
    uint32_t *offsets, *sizes;
    char *name; /* the kernel's name (the front end's, else the driver's) */
    struct layout *next;
} layout_t;
#define NBUCKETS 4096
static layout_t *buckets[NBUCKETS];

static layout_t *learn(void *func, const char *name) {
    layout_t *l = calloc(1, sizeof *l);
    if (!l) { n_errors++; return NULL; }
    l->func = func;
    if (!name) name = driver_name(func);
    l->name = name ? strdup(name) : NULL;
    name = l->name;
    uint32_t source = 0;
    param_info_t getters[2] = {p_func_param_info, p_kernel_param_info};
    for (int g = 0; g < 2 && !l->known; g++) {
        if (!getters[g]) continue;
        uint32_t cap = 16, n = 0;
        uint32_t *off = malloc(cap * 4), *size = malloc(cap * 4);
        int err = 0;
        for (;;) {
            size_t o, s;
            err = getters[g](func, n, &o, &s);
            if (err) break;
            if (n == cap) { cap *= 2; off = realloc(off, cap * 4); size = realloc(size, cap * 4); }
            off[n] = (uint32_t)o;
            size[n] = (uint32_t)s;
            n++;
        }
        if (err == 1 /* CUDA_ERROR_INVALID_VALUE: past the last parameter */) {
            l->known = 1;
            l->n = n;
            l->offsets = off;
            l->sizes = size;
            for (uint32_t i = 0; i < n; i++) l->args_len += size[i];
            source = (uint32_t)(g + 1);
        } else {
            free(off);
            free(size);
        }
    }
    size_t name_len = name ? strlen(name) : 0;
    /* FUNC: u64 func, u32 source (0 none 1 cuFuncGetParamInfo 2 cuKernelGetParamInfo), u32 n,
       u32 name_len, u32 pad, n x (u32 offset, u32 size), name */
    char *p = begin(R_FUNC, 0, 24 + (size_t)l->n * 8 + name_len);
    if (p) {
        uint64_t f = (uint64_t)(uintptr_t)func;
        uint32_t meta[4] = {source, l->n, (uint32_t)name_len, 0};
        memcpy(p, &f, 8);
        memcpy(p + 8, meta, 16);
        for (uint32_t i = 0; i < l->n; i++) {
            memcpy(p + 24 + i * 8, &l->offsets[i], 4);
            memcpy(p + 28 + i * 8, &l->sizes[i], 4);
        }
        memcpy(p + 24 + (size_t)l->n * 8, name, name_len);
    }
    /* the module holding it (whose variables it reads): a SYMBOL of what we asked the driver
       (cbid all ones); a library's kernel handle has none */
    void *module = NULL;
    if (p_func_module && p_func_module(&module, func) == 0 && module) {
        char *q = begin(R_SYMBOL, 0xFFFFFFFFu, 48 + name_len);
        if (q) {
            uint64_t v[6] = {1, (uint64_t)(uintptr_t)func, (uint64_t)(uintptr_t)module, 0, ~0ull, name_len};
            memcpy(q, v, 48);
            memcpy(q + 48, name, name_len);
        }
    }
    uint32_t b = (uint32_t)(((uintptr_t)func >> 4) % NBUCKETS);
    l->next = buckets[b];
    buckets[b] = l;
    n_functions++;
    return l;
}

/* A module is being unloaded: the driver may hand its functions' handles to a later module's
   functions, whose parameters a stale layout would misread (lock held, as for every lookup). */
static void forget_layouts(void) {
    for (size_t b = 0; b < NBUCKETS; b++) {
        for (layout_t *l = buckets[b], *next; l; l = next) {
            next = l->next;
            free(l->offsets);
            free(l->sizes);
            free(l->name);
            free(l);
        }
        buckets[b] = NULL;
    }
}

static inline layout_t *layout_of(void *func, const char *name) {
    for (layout_t *l = buckets[((uintptr_t)func >> 4) % NBUCKETS]; l; l = l->next)
        if (l->func == func) return l;
    return learn(func, name);
}

/* LAUNCH: u64 func, u32 grid[3], u32 block[3], u32 smem, u32 result, u64 stream,
   u32 args_len (0xffffffff: unknown), u32 ndptrs, u32 flags (1: captured into a graph, not run),
   u32 pad, args, ndptrs x (u32 index, u32 offset, u32 type) */
static void launch(uint32_t cbid, uint32_t result, const char *sym, void *func, const uint32_t dims[7],
                   uint64_t stream, void **kp, void **extra) {
    layout_t *l = layout_of(func, sym);
    int have = l && l->known && (kp || extra || l->n == 0);
    uint32_t args_len = have ? l->args_len : 0xffffffffu;
    const char *packed = NULL;
    if (have && !kp && l->n) { /* CU_LAUNCH_PARAM_BUFFER_POINTER (1) ... _END (0) */
        for (void **e = extra; e && *e; e += 2)
            if ((uintptr_t)e[0] == 1) packed = (const char *)e[1];
        if (!packed) { have = 0; args_len = 0xffffffffu; }
    }
    uint32_t dp[64][3];
    uint32_t ndp = 0;
    size_t body = 64 + (have ? args_len : 0);
    char *p = begin(R_LAUNCH, cbid, body);
    if (!p) return;
    uint64_t f = (uint64_t)(uintptr_t)func;
    memcpy(p, &f, 8);
    memcpy(p + 8, dims, 28);
    memcpy(p + 36, &result, 4);
    memcpy(p + 40, &stream, 8);
    memcpy(p + 48, &args_len, 4);
    int capture = 0; /* a launch into a stream being captured only adds a node to a graph */
    uint32_t flags = p_is_capturing && p_is_capturing((void *)(uintptr_t)stream, &capture) == 0 && capture;
    uint32_t pad = 0;
    memcpy(p + 56, &flags, 4);
    memcpy(p + 60, &pad, 4);
    char *a = p + 64;
    if (have) {
        for (uint32_t i = 0; i < l->n; i++) {
            const char *src = kp ? (const char *)kp[i] : packed + l->offsets[i];
            memcpy(a, src, l->sizes[i]);
            if (check_pointers && p_pointer_attr) {
                for (uint32_t off = 0; off + 8 <= l->sizes[i] && ndp < 64; off += 8) {
                    uint64_t w;
                    memcpy(&w, a + off, 8);
                    uint32_t type = 0;
                    if (w >= 0x10000 && w < (1ull << 57) && p_pointer_attr(&type, 2, w) == 0 &&
                        (type == 2 || type == 4)) {
                        dp[ndp][0] = i; dp[ndp][1] = off; dp[ndp][2] = type; ndp++;
                    }
                }
            }
            a += l->sizes[i];
        }
    }
    memcpy(p + 52, &ndp, 4);
    if (ndp) {
        /* the dptrs go after the args; buf may move when reserve grows it, so recompute */
        size_t at = (size_t)(a - buf);
        char *q = reserve((size_t)ndp * 12);
        if (!q) return;
        memcpy(q, dp, (size_t)ndp * 12);
        hdr_t *h = (hdr_t *)(buf + at - body - sizeof(hdr_t));
        h->len += ndp * 12;
    }
}

static void put_u64s(uint16_t tag, uint32_t cbid, const uint64_t *v, int n) {
    char *p = begin(tag, cbid, (size_t)n * 8);
    if (p) memcpy(p, v, (size_t)n * 8);
}

/* Format (0 unknown 1 cubin 2 fatbin 3 PTX), size and PTX length of a module image. */
static void image_info(const unsigned char **pimg, uint64_t *fmt, uint64_t *size, uint64_t *ptx_len) {
    const unsigned char *img = *pimg;
    *fmt = *size = *ptx_len = 0;
    if (!img) return;
    uint32_t magic;
    memcpy(&magic, img, 4);
    if (magic == 0x466243B1u) { /* fatbin wrapper: {magic, version, data*, ...} */
        memcpy(&img, img + 8, 8);
        *pimg = img;
        if (!img) return;
        memcpy(&magic, img, 4);
    }
    if (magic == 0x464C457Fu) {
        uint64_t shoff; uint16_t shentsize, shnum;
        memcpy(&shoff, img + 0x28, 8);
        memcpy(&shentsize, img + 0x3A, 2);
        memcpy(&shnum, img + 0x3C, 2);
        *fmt = 1; *size = shoff + (uint64_t)shentsize * shnum;
    } else if (magic == 0xBA55ED50u) {
        uint16_t hsize; uint64_t fsize;
        memcpy(&hsize, img + 6, 2);
        memcpy(&fsize, img + 8, 8);
        *fmt = 2; *size = hsize + fsize;
    } else {
        size_t n = strnlen((const char *)img, 1u << 30);
        const char *s = (const char *)img;
        while (n && (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r')) { s++; n--; }
        if (n && (*s == '/' || *s == '.') && memmem(img, n < 4096 ? n : 4096, ".version", 8)) {
            *fmt = 3; *size = *ptx_len = strlen((const char *)img);
        }
    }
}

uint64_t rec_image_size(const unsigned char **image) {
    uint64_t fmt, size, ptx_len;
    image_info(image, &fmt, &size, &ptx_len);
    return size;
}

static void on_driver(uint32_t cbid, const void *params, uint32_t result, const char *sym) {
    uint8_t kind = kind_of[cbid];
    const uint64_t *q = (const uint64_t *)params; /* every param struct used is 8-byte fields */
    if (kind == K_LAUNCH || kind == K_LAUNCH_COOP) {
        /* f, 7 x u32 (grid, block, smem), pad, stream, kernelParams[, extra] */
        const char *b = (const char *)params;
        void *f;
        uint32_t dims[7];
        uint64_t stream;
        void **kp, **extra = NULL;
        memcpy(&f, b, 8);
        memcpy(dims, b + 8, 28);
        memcpy(&stream, b + 40, 8);
        memcpy(&kp, b + 48, 8);
        if (kind == K_LAUNCH) memcpy(&extra, b + 56, 8);
        launch(cbid, result, sym, f, dims, stream, kp, extra);
        return;
    }
    if (kind == K_LAUNCH_EX) { /* config*, f, kernelParams, extra; config: 7 x u32, pad, stream */
        const char *cfg = (const char *)(uintptr_t)q[0];
        uint32_t dims[7];
        uint64_t stream;
        memcpy(dims, cfg, 28);
        memcpy(&stream, cfg + 32, 8);
        launch(cbid, result, sym, (void *)(uintptr_t)q[1], dims, stream, (void **)(uintptr_t)q[2],
               (void **)(uintptr_t)q[3]);
        return;
    }
    if (result) return; /* failed calls allocate, free or copy nothing */
    if (kind == K_VARIABLE || kind == K_FUNCTION) {
        /* SYMBOL: u64 what (0 variable 1 function), handle, parent (module or library), addr,
           size (all ones: not asked for), name length, then the name. The calls' parameters:
           variable (CUdeviceptr *, size_t *, parent, name), function (handle *, parent, name) */
        int var = kind == K_VARIABLE;
        const char *name = (const char *)(uintptr_t)q[var ? 3 : 2];
        uint64_t v[6] = {var ? 0 : 1, 0, q[var ? 2 : 1], 0, ~0ull, 0};
        if (var) {
            if (q[0]) v[3] = *(const uint64_t *)(uintptr_t)q[0];
            if (q[1]) v[4] = *(const uint64_t *)(uintptr_t)q[1];
        } else if (q[0]) {
            v[1] = *(const uint64_t *)(uintptr_t)q[0];
        }
        v[5] = name ? strnlen(name, 4096) : 0;
        char *p = begin(R_SYMBOL, cbid, 48 + v[5]);
        if (!p) return;
        memcpy(p, v, 48);
        if (v[5]) memcpy(p + 48, name, v[5]);
        return;
    }
    if (kind == K_GRAPH) { uint64_t v[2] = {q[0], q[1]}; put_u64s(R_GRAPH, cbid, v, 2); return; }
    /* GRAPHOP: u64 op (0 capture begin, 1 capture end, 2 instantiate), a, b:
       begin (stream, 0); end (stream, graph); instantiate (graph, exec) */
    if (kind == K_CAPTURE_BEGIN) { uint64_t v[3] = {0, q[0], 0}; put_u64s(R_GRAPHOP, cbid, v, 3); return; }
    if (kind == K_CAPTURE_END) {
        uint64_t v[3] = {1, q[0], q[1] ? *(const uint64_t *)(uintptr_t)q[1] : 0};
        put_u64s(R_GRAPHOP, cbid, v, 3);
        return;
    }
    if (kind == K_INSTANTIATE) {
        uint64_t v[3] = {2, q[1], q[0] ? *(const uint64_t *)(uintptr_t)q[0] : 0};
        put_u64s(R_GRAPHOP, cbid, v, 3);
        return;
    }
    if (kind >= K_ALLOC && kind <= K_ALLOC + 5) {
        /* ALLOC: u64 addr, size, kind, stream */
        uint32_t ak = kind - K_ALLOC;
        uint64_t addr = *(const uint64_t *)(uintptr_t)q[0], size = q[1], stream = 0;
        if (ak == 1) size = *(const uint64_t *)(uintptr_t)q[1] * q[3]; /* pitch * height */
        if (ak == 3) stream = q[2];
        if (ak == 4) stream = q[3];
        uint64_t v[4] = {addr, size, ak, stream};
        put_u64s(R_ALLOC, cbid, v, 4);
#ifdef GPUOS_AGENT
        core_after_alloc(addr, size, ak);
#endif
        return;
    }
    if (kind == K_MAP) {
        uint64_t v[4] = {q[0], q[1], 6, 0};
        put_u64s(R_ALLOC, cbid, v, 4);
#ifdef GPUOS_AGENT
        core_after_alloc(q[0], q[1], 6);
#endif
        return;
    }
    if (kind >= K_FREE && kind <= K_UNMAP) {
        /* FREE: u64 addr, size (all ones: unknown), stream */
        uint64_t v[3] = {q[0], kind == K_UNMAP ? q[1] : ~0ull, kind == K_FREE_ASYNC ? q[1] : 0};
        put_u64s(R_FREE, cbid, v, 3);
#ifdef GPUOS_AGENT
        core_after_free(q[0]);
#endif
        return;
    }
    if (kind >= K_COPY && kind < K_COPY2D) {
        /* COPY: u64 dir, dst, src, bytes, stream, async, width, height, src pitch, dst pitch */
        uint32_t c = kind - K_COPY, dir = c >> 2, peer = (c >> 1) & 1, st = c & 1;
        uint64_t dst = q[0], src = peer ? q[2] : q[1], n = peer ? q[4] : q[2];
        uint64_t stream = st ? q[peer ? 5 : 3] : 0;
        uint64_t v[10] = {dir, dst, src, n, stream, st, 0, 0, 0, 0};
        /* Small copies from host memory carry their bytes: pointer arrays reach the GPU this
           way, and gpu-predict-access follows the pointers in them. A "default" copy's source
           is host memory when the driver does not know it as device memory. */
        uint32_t type = 0;
        int from_host = dir == 1 || (dir == 0 && p_pointer_attr &&
                        (p_pointer_attr(&type, 2, src) != 0 || type == 1));
        int payload = from_host && n && n <= SMALL_COPY && src;
        if (payload) {
            char *p = begin(R_COPY, cbid, 80 + ((n + 7) & ~7ull));
            if (p) { memcpy(p, v, 80); memcpy(p + 80, (const void *)(uintptr_t)src, n); }
        } else {
            put_u64s(R_COPY, cbid, v, 10);
        }
#ifdef GPUOS_AGENT
        core_after_write(dst, payload ? (const uint8_t *)(uintptr_t)src : NULL, n, stream, 0);
#endif
        return;
    }
    if (kind == K_COPY2D || kind == K_COPY2D_ASYNC) {
        /* CUDA_MEMCPY2D: srcX, srcY, srcType(u32+pad), srcHost, srcDev, srcArr, srcPitch,
           dstX, dstY, dstType, dstHost, dstDev, dstArr, dstPitch, width, height */
        const uint64_t *m = (const uint64_t *)(uintptr_t)q[0];
        uint32_t stype = (uint32_t)m[2], dtype = (uint32_t)m[9];
        uint64_t src = (stype == 1 ? m[3] : m[4]) + m[1] * m[6] + m[0];
        uint64_t dst = (dtype == 1 ? m[10] : m[11]) + m[8] * m[13] + m[7];
        uint64_t dir = stype == 1 && dtype == 2 ? 1 : stype == 2 && dtype == 1 ? 2
                     : stype == 2 && dtype == 2 ? 3 : stype == 1 && dtype == 1 ? 5 : 0;
        uint64_t st = kind == K_COPY2D_ASYNC;
        uint64_t v[10] = {dir, dst, src, m[14] * m[15], st ? q[1] : 0, st, m[14], m[15], m[6], m[13]};
        put_u64s(R_COPY, cbid, v, 10);
#ifdef GPUOS_AGENT
        if (m[15]) /* rows of width bytes, dst pitch apart */
            core_after_write(dst, NULL, (m[15] - 1) * (m[13] ? m[13] : m[14]) + m[14], v[4], 0);
#endif
        return;
    }
    if (kind >= K_SET && kind < K_LIBRARY) {
        /* SET: u64 dst, bytes, value, elem, stream, async */
        uint32_t c = kind - K_SET, code = c >> 2, two_d = (c >> 1) & 1, st = c & 1;
        uint64_t elem = 1ull << code, mask = elem == 4 ? 0xffffffffull : (1ull << (8 * elem)) - 1;
        uint64_t v[6];
        if (two_d) { v[0] = q[0]; v[1] = q[3] * q[4] * elem; v[2] = q[2] & mask; v[4] = st ? q[5] : 0; }
        else { v[0] = q[0]; v[1] = q[2] * elem; v[2] = q[1] & mask; v[4] = st ? q[3] : 0; }
        v[3] = elem;
        v[5] = st;
        put_u64s(R_SET, cbid, v, 6);
#ifdef GPUOS_AGENT
        core_after_write(v[0], NULL, v[1], v[4], 1);
#endif
        return;
    }
    if (kind == K_LIBRARY) {
        /* LIBRARY: u64 format (0 unknown 1 cubin 2 fatbin 3 ptx), size, ptx_len, then PTX text */
        const unsigned char *img = (const unsigned char *)(uintptr_t)q[1];
        uint64_t fmt = 0, size = 0, ptx_len = 0;
        image_info(&img, &fmt, &size, &ptx_len);
        char *p = begin(R_LIBRARY, cbid, 24 + ptx_len);
        if (!p) return;
        uint64_t v[3] = {fmt, size, ptx_len};
        memcpy(p, v, 24);
        if (ptx_len) memcpy(p + 24, img, ptx_len);
    }
}

/* ---- what CUPTI's resource callbacks report (the interposer reports the same) */

/* MODULE: u64 module id, size, image bytes */
void rec_module_loaded(uint64_t id, const void *image, uint64_t size) {
    pthread_mutex_lock(&lock);
    n_callbacks++;
    if (!image) size = 0;
    char *p = begin(R_MODULE, 6, 16 + size);
    if (p) {
        memcpy(p, &id, 8);
        memcpy(p + 8, &size, 8);
        if (size) memcpy(p + 16, image, size);
    }
    pthread_mutex_unlock(&lock);
}

/* A module is being unloaded: its functions' handles may come back for another module's. */
void rec_module_unloading(void) {
    pthread_mutex_lock(&lock);
    n_callbacks++;
    forget_layouts();
#ifdef GPUOS_AGENT
    core_module_unloading();
#endif
    pthread_mutex_unlock(&lock);
}

/* STREAM: u64 stream, event (0 create 1 destroy) */
void rec_stream(uint64_t stream, int destroyed) {
    pthread_mutex_lock(&lock);
    n_callbacks++;
    uint64_t v[2] = {stream, (uint64_t)(destroyed != 0)};
    put_u64s(R_STREAM, destroyed ? 4 : 3, v, 2);
#ifdef GPUOS_AGENT
    core_stream_event(v[0], (int)v[1]);
#endif
    pthread_mutex_unlock(&lock);
}

#ifdef GPUOS_AGENT
static int trace_is_capturing(uint64_t stream) {
    int capture = 0;
    return p_is_capturing && p_is_capturing((void *)(uintptr_t)stream, &capture) == 0 && capture;
}

static int acting(uint8_t kind) { /* the operations the agent acts on before they are issued */
    return kind == K_LAUNCH || kind == K_LAUNCH_COOP || kind == K_LAUNCH_EX || kind == K_GRAPH ||
           (kind >= K_FREE && kind <= K_UNMAP) || (kind >= K_COPY && kind < K_LIBRARY);
}

static int updates_core(uint8_t kind) { /* exits that change the core's allocation table */
    return (kind >= K_ALLOC && kind <= K_MAP) || (kind >= K_FREE && kind <= K_UNMAP) ||
           (kind >= K_COPY && kind < K_LIBRARY);
}

/* the launch's arguments, gathered contiguously (per thread: launches of several threads) */
static __thread uint8_t *args_buf;
static __thread uint32_t *sizes_buf;
static __thread size_t args_cap, sizes_cap;

static void enter_launch(uint32_t cbid, const char *sym, void *func, uint64_t stream, void **kp,
                         void **extra) {
    uint32_t n = 0, args_len = CORE_NO_ARGS;
    pthread_mutex_lock(&lock);
    layout_t *l = layout_of(func, sym);
    const char *name = sym ? sym : l ? l->name : NULL;
    if (l && l->known) {
        const char *packed = NULL;
        if (!kp && l->n)
            for (void **e = extra; e && *e; e += 2)
                if ((uintptr_t)e[0] == 1) packed = (const char *)e[1];
        if (kp || packed || l->n == 0) {
            if (sizes_cap < l->n || args_cap < l->args_len) {
                size_t sc = l->n > 64 ? l->n : 64, ac = l->args_len > 4096 ? l->args_len : 4096;
                uint32_t *s2 = realloc(sizes_buf, sc * 4);
                if (s2) { sizes_buf = s2; sizes_cap = sc; }
                uint8_t *a2 = realloc(args_buf, ac);
                if (a2) { args_buf = a2; args_cap = ac; }
            }
            if (sizes_cap >= l->n && args_cap >= l->args_len) {
                uint8_t *a = args_buf;
                for (uint32_t i = 0; i < l->n; i++) {
                    memcpy(a, kp ? (const char *)kp[i] : packed + l->offsets[i], l->sizes[i]);
                    sizes_buf[i] = l->sizes[i];
                    a += l->sizes[i];
                }
                n = l->n;
                args_len = l->args_len;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    core_enter(OP_LAUNCH, cbid, ptsz_of[cbid], 1, stream, (uint64_t)(uintptr_t)func, name,
               sizes_buf, n, args_buf, args_len, 0, 0, 0);
}

/* The agent's view of an operation about to be issued (as tracer.py's _agent_enter reads it). */
static void agent_enter(uint32_t cbid, uint8_t kind, const void *params, const char *sym) {
    const uint64_t *q = (const uint64_t *)params;
    const char *b = (const char *)params;
    if (kind == K_LAUNCH || kind == K_LAUNCH_COOP) {
        void *f;
        uint64_t stream;
        void **kp, **extra = NULL;
        memcpy(&f, b, 8);
        memcpy(&stream, b + 40, 8);
        memcpy(&kp, b + 48, 8);
        if (kind == K_LAUNCH) memcpy(&extra, b + 56, 8);
        enter_launch(cbid, sym, f, stream, kp, extra);
    } else if (kind == K_LAUNCH_EX) {
        uint64_t stream;
        memcpy(&stream, (const char *)(uintptr_t)q[0] + 32, 8);
        enter_launch(cbid, sym, (void *)(uintptr_t)q[1], stream, (void **)(uintptr_t)q[2], (void **)(uintptr_t)q[3]);
    } else if (kind == K_GRAPH) {
        core_enter(OP_GRAPH, cbid, ptsz_of[cbid], 1, q[1], 0, NULL, NULL, 0, NULL, CORE_NO_ARGS, 0, 0, 0);
    } else if (kind >= K_FREE && kind <= K_UNMAP) {
        uint64_t dst = kind == K_FREE_HOST ? 0 : q[0], stream = kind == K_FREE_ASYNC ? q[1] : 0;
        core_enter(OP_FREE, cbid, ptsz_of[cbid], 0, stream, 0, NULL, NULL, 0, NULL, CORE_NO_ARGS, dst, 0, 0);
    } else if (kind == K_COPY2D || kind == K_COPY2D_ASYNC) {
        const uint64_t *m = (const uint64_t *)(uintptr_t)q[0];
        uint32_t stype = (uint32_t)m[2], dtype = (uint32_t)m[9];
        uint64_t src = (stype == 1 ? m[3] : m[4]) + m[1] * m[6] + m[0];
        uint64_t dst = (dtype == 1 ? m[10] : m[11]) + m[8] * m[13] + m[7];
        uint64_t stream = kind == K_COPY2D_ASYNC ? q[1] : 0;
        core_enter(OP_WRITE, cbid, ptsz_of[cbid], 1, stream, 0, NULL, NULL, 0, NULL, CORE_NO_ARGS, dst, src, 0);
    } else if (kind >= K_COPY && kind < K_COPY2D) {
        uint32_t c = kind - K_COPY, peer = (c >> 1) & 1, st = c & 1;
        uint64_t dst = q[0], src = peer ? q[2] : q[1], stream = st ? q[peer ? 5 : 3] : 0;
        core_enter(OP_WRITE, cbid, ptsz_of[cbid], 1, stream, 0, NULL, NULL, 0, NULL, CORE_NO_ARGS, dst, src, 0);
    } else if (kind >= K_SET && kind < K_LIBRARY) {
        uint32_t c = kind - K_SET, two_d = (c >> 1) & 1, st = c & 1;
        uint64_t stream = st ? q[two_d ? 5 : 3] : 0;
        core_enter(OP_WRITE, cbid, ptsz_of[cbid], 1, stream, 0, NULL, NULL, 0, NULL, CORE_NO_ARGS, q[0], 0, 0);
    }
}
#endif
uint8_t rec_kind(uint32_t cbid) { return cbid < MAX_CBID ? kind_of[cbid] : 0; }

void rec_call(uint32_t cbid, int site, const void *params, uint32_t result, uint64_t ctx, const char *sym) {
    if (cbid >= MAX_CBID || !kind_of[cbid]) return;
#ifdef GPUOS_AGENT
    if (core_skip()) return; /* the agent's own driver calls */
    uint8_t kind = kind_of[cbid];
    if (site == REC_ENTER) {
        if (kind == K_CAPTURE_BEGIN) core_capture_begun(); /* launches may be captured from here */
        else if (acting(kind)) agent_enter(cbid, kind, params, sym);
        return;
    }
    if (acting(kind)) core_issued(); /* enqueued: before any lock (the agent may hold it, waiting) */
    /* the program's context, from its first recorded call: a program whose memory all comes
     * from an allocator of the agent's own (owned memory) makes no allocation the core sees */
    if (!core_context()) {
        void *current = NULL;
        if (!ctx && p_ctx_current && p_ctx_current(&current) == 0) ctx = (uint64_t)(uintptr_t)current;
        core_saw_context(ctx);
    }
    int core = updates_core(kind);
    if (core) core_lock_program();
#else
    (void)ctx;
    if (site == REC_ENTER) return;
#endif
    uint64_t t0 = now_ns(); /* our own time on the program's path, reported at the end */
    pthread_mutex_lock(&lock);
    n_callbacks++;
    on_driver(cbid, params, result, sym);
    ns_in_callbacks += now_ns() - t0;
    pthread_mutex_unlock(&lock);
#ifdef GPUOS_AGENT
    if (core) core_unlock();
#endif
}

/* An in-band error message (the agent's, from Python): ERROR: text. */
void gpuos_trace_error(const char *msg) {
    size_t n = strlen(msg);
    pthread_mutex_lock(&lock);
    char *p = begin(R_ERROR, 0, n);
    if (p) memcpy(p, msg, n);
    pthread_mutex_unlock(&lock);
}

/* ---- shipping: frames are u32 length with bit 31 set (native), then the records */
static char *spare;
static size_t spare_cap;

static int write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) { if (errno == EINTR) continue; return -1; }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int flush_once(void) {
    pthread_mutex_lock(&lock);
    char *full = buf;
    size_t len = buf_len, cap = buf_cap;
    buf = spare;
    buf_cap = spare_cap;
    buf_len = 0;
    pthread_mutex_unlock(&lock);
    int rc = 0;
    if (len && out_fd >= 0) {
        uint32_t frame = (uint32_t)len | 0x80000000u;
        rc = write_all(out_fd, (const char *)&frame, 4) || write_all(out_fd, full, len);
    }
    spare = full;
    spare_cap = cap;
    return rc;
}

static void *writer(void *arg) {
    (void)arg;
    while (__atomic_load_n(&running, __ATOMIC_ACQUIRE)) {
        usleep((useconds_t)flush_us);
        if (flush_once()) { /* gpu-trace went away: stop tracing, keep the program running */
            out_fd = -1;
            if (on_gone) on_gone();
            break;
        }
    }
    return NULL;
}


static void forked_child(void) { out_fd = -1; running = 0; }

void rec_resolve(rec_lookup_fn lookup) {
    p_func_param_info = (param_info_t)lookup("cuFuncGetParamInfo");
    p_kernel_param_info = (param_info_t)lookup("cuKernelGetParamInfo");
    p_pointer_attr = (pointer_attr_t)lookup("cuPointerGetAttribute");
    p_is_capturing = (is_capturing_t)lookup("cuStreamIsCapturing");
    p_func_name = (name_of_t)lookup("cuFuncGetName");
    p_kernel_name = (name_of_t)lookup("cuKernelGetName");
    p_ctx_current = (ctx_current_t)lookup("cuCtxGetCurrent");
    p_func_module = (func_module_t)lookup("cuFuncGetModule");
#ifdef GPUOS_AGENT
    core_set_capture_query(trace_is_capturing);
#endif
}

void rec_configure(int fd, const uint32_t *kinds, int n, int flush_ms, int check) {
    out_fd = fd;
    check_pointers = check;
    flush_us = flush_ms * 1000;
    for (int i = 0; i < n; i++) {
        uint32_t cbid = kinds[2 * i], kind = kinds[2 * i + 1];
        if (cbid >= MAX_CBID) continue;
        kind_of[cbid] = (uint8_t)(kind & 0x7f);
        ptsz_of[cbid] = (uint8_t)(kind >> 7 & 1); /* bit 7: a per-thread-stream variant */
    }
}

int rec_start(void (*gone)(void)) {
    on_gone = gone;
    running = 1;
    pthread_atfork(NULL, NULL, forked_child);
    if (pthread_create(&writer_thread, NULL, writer, NULL)) { running = 0; return -1; }
    return 0;
}

int rec_running(void) { return __atomic_load_n(&running, __ATOMIC_ACQUIRE); }

void rec_finish(uint64_t counters[4]) {
    if (__atomic_exchange_n(&running, 0, __ATOMIC_ACQ_REL)) pthread_join(writer_thread, NULL);
    if (out_fd >= 0) flush_once();
    counters[0] = n_callbacks;
    counters[1] = n_errors;
    counters[2] = n_functions;
    counters[3] = ns_in_callbacks;
}
