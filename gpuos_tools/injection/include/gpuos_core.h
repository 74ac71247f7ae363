/*
 * The agent's native per-operation core: what the tracer's CUPTI callback (gpuos_trace.c, built
 * with -DGPUOS_AGENT) asks of it on every driver operation of the program, in the program's own
 * thread. Design: docs/native-core.md.
 */
#ifndef GPUOS_CORE_H
#define GPUOS_CORE_H

#include <stddef.h>
#include <stdint.h>

#define CORE_NO_ARGS 0xffffffffu

/* What an upcall into Python is for (gpuos_tools/injection/core.py mirrors these). */
enum {
    UP_LAUNCH = 1,    /* the agent's launch hook (engine or executor must act) */
    UP_WRITE = 2,     /* the agent's copy/memset/free hook */
    UP_GRAPH = 3,     /* the agent's graph-launch hook */
    UP_PREDICT = 4,   /* no memoised access set for this launch: predict it */
    UP_PROTECT = 5,   /* a snapshot's buffers must be protected before this operation */
    UP_REFERENCE = 6, /* a reference dump is asked for at this operation */
    UP_GATE = 7,      /* serve: wait for the GPU turn (before the lock) */
    UP_CUT = 8,       /* an armed cut: this launch is the K-th collective (n: K); take T0 before it */
};

/* One upcall's data. Python reads it with ctypes; keep the layout in step with core.py. */
typedef struct {
    uint32_t what, cbid;
    uint64_t stream;     /* the stream the call really uses (0 of a _ptsz call: 2) */
    uint64_t raw_stream; /* the handle passed */
    uint64_t func;
    const char *name;
    const uint32_t *sizes;
    uint32_t nparams, args_len; /* args_len CORE_NO_ARGS: layout or arguments not known */
    const uint8_t *args;
    uint64_t dst, src;
    /* UP_PREDICT: Python writes nw write ids then nt touched ids into ids (cap of them), and
       unknown; returns 0 (non-zero: failed, taken as unknown). UP_LAUNCH: where ids is set, the
       launch's access set (the memo's) in the same form, for the hook */
    int32_t unknown;
    uint32_t nw, nt, cap;
    uint64_t *ids;
    /* UP_PROTECT: snapshot buffer indexes */
    uint32_t ntargets, pad;
    const uint32_t *targets;
    uint64_t n; /* UP_REFERENCE: the operation's number */
} upcall_t;

typedef int (*upcall_fn)(upcall_t *);

/* Operation classes the tracer hands the core at an enter site. */
enum { OP_LAUNCH = 1, OP_WRITE = 2, OP_FREE = 3, OP_GRAPH = 4 };

/* ---- called by the tracer (gpuos_trace.c) */
int core_skip(void);                   /* the calling thread is the agent's own: ignore */
void core_lock_program(void);          /* the core lock, from a program thread (GIL-aware) */
void core_unlock(void);
void core_capture_begun(void);
void core_issued(void);                /* an acting operation's exit: it is enqueued */
/* an acting operation's enter; gated: it waits for the GPU turn when serving */
void core_enter(uint32_t op, uint32_t cbid, int ptsz, int gated, uint64_t stream, uint64_t func,
                const char *name, const uint32_t *sizes, uint32_t nparams, const uint8_t *args,
                uint32_t args_len, uint64_t dst, uint64_t src, int capturing);
/* after successful operations (exit site, core lock held) */
void core_after_alloc(uint64_t addr, uint64_t size, uint32_t kind);
void core_after_free(uint64_t addr);
void core_after_write(uint64_t dst, const uint8_t *payload, uint64_t n, uint64_t stream, int is_set);
void core_stream_event(uint64_t stream, int destroyed); /* resource callback: no core lock */
void core_module_unloading(void);
void core_saw_context(uint64_t ctx);   /* the context a recorded call ran in (the first is kept) */
uint64_t core_context(void);            /* that context; 0 before the first */

/* ---- the scheduler's fast path (Python, core lock held): gpuos_core.c, "the scheduler's fast path" */
void core_fast_allow(int64_t left);
void core_fast_mark(const uint64_t *addrs, uint32_t n, int on);
void core_fast_unready(uint64_t base, uint64_t size);
void core_fast_unready_all(void);
void core_fast_slow_cbid(uint32_t cbid);
uint32_t core_fast_uncovered(const uint64_t *bases, const uint64_t *sizes, uint32_t n);
char *core_fast_take(size_t *len, uint32_t *entries);
void core_fast_counts(uint64_t out[3]);

/* Whether a stream is capturing a graph: the front end that calls the core (the CUPTI tracer,
   an interposer) registers how to ask, before the first operation. */
typedef int (*capture_query_fn)(uint64_t stream);
void core_set_capture_query(capture_query_fn query);

#endif
