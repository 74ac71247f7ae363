/*
 * gpuos native tracer: the CUPTI callback of gpu-trace in C, one of the recorder's two front ends
 * (gpuos_record.c does the recording; the other front end is the interposer, gpuos_intercept.c).
 *
 * Entering Python from a CUPTI callback costs ~6.5 us per launch on an H200 before any work is
 * done (BENCHMARKS.md, "cupy-floor"), so the launch path cannot be Python if the overhead is to
 * stay near a microsecond. Python (tracer.py) still locates libcupti through cupti-python, picks
 * the callback ids from cupti-python's enums, and writes the HELLO and END frames.
 *
 * No CUDA or CUPTI header is needed to build it: the few structs used are declared below with
 * the layouts of cupti_callbacks.h (stable ABI).
 *
 * Build: cc -O2 -shared -fPIC -Iinclude -o libgpuos_trace.so gpuos_trace.c gpuos_record.c -ldl -lpthread
 *
 * Built with -DGPUOS_AGENT and linked with gpuos_core.c, the same callback is the in-process
 * agent's front end under CUPTI (gpuos_record.h says what the recorder hands the core).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "gpuos_record.h"

/* ---- ABI of CUPTI (see cupti_callbacks.h) */
typedef struct {
    uint32_t site; /* 0 enter, 1 exit */
    const char *function_name;
    const void *params;
    void *return_value; /* CUresult* */
    const char *symbol_name;
    void *context;
    uint32_t context_uid;
    uint64_t *correlation_data;
    uint32_t correlation_id;
} cb_data_t;
typedef struct { void *context; void *stream; void *descriptor; } res_data_t;
typedef struct { uint32_t module_id; size_t size; const char *image; } module_data_t;
typedef void (*cupti_cb_t)(void *, int, uint32_t, const void *);
typedef int (*subscribe_t)(void **, cupti_cb_t, void *);
typedef int (*enable_t)(uint32_t, void *, int, uint32_t);
typedef int (*unsubscribe_t)(void *);

enum { DOMAIN_DRIVER = 1, DOMAIN_RESOURCE = 3 };

static void *subscriber;
static subscribe_t p_subscribe;
static enable_t p_enable;
static unsubscribe_t p_unsubscribe;
static void *cuda;

static void callback(void *userdata, int domain, uint32_t cbid, const void *data) {
    (void)userdata;
    if (domain == DOMAIN_DRIVER) {
        const cb_data_t *cb = (const cb_data_t *)data;
        uint32_t result = cb->return_value ? *(uint32_t *)cb->return_value : 0;
        rec_call(cbid, cb->site ? REC_EXIT : REC_ENTER, cb->params, result, (uint64_t)(uintptr_t)cb->context,
                 cb->symbol_name);
    } else if (domain == DOMAIN_RESOURCE) {
        const res_data_t *r = (const res_data_t *)data;
        if (cbid == 6) { /* MODULE_LOADED */
            const module_data_t *m = (const module_data_t *)r->descriptor;
            rec_module_loaded(m->module_id, m->image, m->image ? m->size : 0);
        } else if (cbid == 7) { /* MODULE_UNLOAD_STARTING */
            rec_module_unloading();
        } else if (cbid == 3 || cbid == 4) { /* STREAM_CREATED / STREAM_DESTROY_STARTING */
            rec_stream((uint64_t)(uintptr_t)r->stream, cbid == 4);
        }
    }
}

static void *lookup(const char *name) { return dlsym(cuda, name); }

static void stop_callbacks(void) { p_unsubscribe(subscriber); } /* gpu-trace went away */

/* Returns 0, or a negative step number that failed. kinds: n pairs (cbid, kind). */
int gpuos_trace_start(int fd, const char *cupti_path, const uint32_t *kinds, int n, int flush_ms,
                      int check) {
    void *cupti = dlopen(cupti_path, RTLD_NOW | RTLD_GLOBAL);
    cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cupti) return -1;
    if (!cuda) return -2;
    p_subscribe = (subscribe_t)dlsym(cupti, "cuptiSubscribe");
    p_enable = (enable_t)dlsym(cupti, "cuptiEnableCallback");
    p_unsubscribe = (unsubscribe_t)dlsym(cupti, "cuptiUnsubscribe");
    if (!p_subscribe || !p_enable || !p_unsubscribe) return -3;
    rec_resolve(lookup);
    rec_configure(fd, kinds, n, flush_ms, check);
    if (p_subscribe(&subscriber, callback, NULL)) return -4;
    for (int i = 0; i < n; i++) {
        uint32_t cbid = kinds[2 * i];
        if (!rec_kind(cbid)) continue;
        if (p_enable(1, subscriber, DOMAIN_DRIVER, cbid)) return -5;
    }
    const uint32_t res[4] = {3, 4, 6, 7};
    for (int i = 0; i < 4; i++)
        if (p_enable(1, subscriber, DOMAIN_RESOURCE, res[i])) return -6;
    if (rec_start(stop_callbacks)) return -7;
    return 0;
}

/* Unsubscribe, stop the writer, ship what is left.
   counters: callbacks, errors, functions, nanoseconds spent in driver-API callbacks. */
void gpuos_trace_stop(uint64_t counters[4]) {
    if (rec_running()) p_unsubscribe(subscriber);
    rec_finish(counters);
}
