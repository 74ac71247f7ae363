/* kinfer_client.c: the Python producer's request path in C (built by gpuos_tools/kinfer/client_native.py
 * with the system C compiler, loaded with ctypes into ring.RingClient).
 *
 * In CPython one request costs a few µs of interpreter work on top of the daemon's answer (packing
 * the inputs, a dozen stores into the mapping, the spin loop's clock calls, the adaptive rule, reading
 * the answer back). Here the whole request is one call: write the entry, publish it, ring the
 * doorbell, wait with the client's adaptive policy, read the answer into a buffer the caller unpacks
 * once. It follows gpuos_kinfer.h exactly, with the atomics the header asks for, and behaves as
 * RingClient's Python path does (ring.py): the same slot choice within the lane, the same spin rule
 * (wait.py's, on the client's recent waits), the same bounded futex sleep with meta.waiting, the same
 * per-call timeout. Errors come back as negative numbers for Python to raise; a sleep slice that ends
 * without an answer returns to Python (KC_AGAIN), so signals (Ctrl-C) are seen there as before.
 *
 * Offsets and sizes come from the caller's checked geometry, never from the live header. Every value
 * read back from the ring (n_outputs) is bounded before use.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gpuos_kinfer.h"

#define KC_AGAIN (-EAGAIN)         /* slept one slice, no answer yet: call kc_wait(resume) again */
#define KC_TIMEOUT (-ETIMEDOUT)    /* no answer before the deadline; out[0] = the slot's state */
#define KC_TOO_BIG (-E2BIG)        /* more inputs than the ring carries */
#define KC_LANE_FULL (-EBUSY)      /* every slot of the lane is in flight */
#define KC_BAD_MODEL_ID (-ERANGE)  /* a negative model id */
#define KC_BAD_SLOT (-EINVAL)      /* a slot outside this lane */
#define KC_SLICE_NS 2000000ull     /* longest single futex sleep (ring.WAIT_SLICE_S) */

/* What the caller reads back (kc_out): status, decision, batch, where, latency_ns, then the outputs. */
struct kc_answer {
    uint32_t status;
    int32_t decision;
    uint32_t batch;
    uint32_t where;
    int64_t latency_ns;
    float values[];
};

struct kc {
    struct gpuos_kinfer_header *h;
    uint32_t *state;
    struct gpuos_kinfer_meta *meta;
    float *inputs, *outputs;
    uint32_t first, per, max_in, max_out, pid;
    uint32_t next;
    uint64_t seq;
    /* the spin: fixed (fixed_ns, adaptive = 0) or wait.py's rule between spin_min_ns and spin_max_ns */
    int adaptive;
    uint64_t fixed_ns, spin_min_ns, spin_max_ns, gap_ns, hold_ns;
    uint8_t *busy;
    uint64_t *t0, *deadline; /* per slot, while a wait is under way */
    struct kc_answer *out;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ring: the mapped file (size bytes); offsets and counts from the checked geometry; lane: the lane
 * this client holds; fixed_spin_ns < 0: adaptive between spin_min_ns and spin_max_ns. */
struct kc *kc_create(void *ring, uint64_t size, uint64_t state_off, uint64_t meta_off, uint64_t in_off, uint64_t out_off,
                     uint32_t nslots, uint32_t per, uint32_t max_in, uint32_t max_out, uint32_t lane, uint32_t pid,
                     int64_t fixed_spin_ns, uint64_t spin_min_ns, uint64_t spin_max_ns)
{
    if (!ring || per == 0 || nslots == 0 || (uint64_t)(lane + 1) * per > nslots || max_in == 0 || max_out == 0 ||
        max_in > (1u << 16) || max_out > (1u << 16) || state_off + 4ull * nslots > size ||
        meta_off + (uint64_t)sizeof(struct gpuos_kinfer_meta) * nslots > size || in_off + 4ull * max_in * nslots > size ||
        out_off + 4ull * max_out * nslots > size || size < sizeof(struct gpuos_kinfer_header))
        return NULL;
    struct kc *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->busy = calloc(per, 1);
    c->t0 = calloc(per, sizeof *c->t0);
    c->deadline = calloc(per, sizeof *c->deadline);
    c->out = calloc(1, sizeof(struct kc_answer) + 4ull * max_out);
    if (!c->busy || !c->t0 || !c->deadline || !c->out) {
        free(c->busy), free(c->t0), free(c->deadline), free(c->out), free(c);
        return NULL;
    }
    uint8_t *base = ring;
    c->h = ring;
    c->state = (uint32_t *)(base + state_off);
    c->meta = (struct gpuos_kinfer_meta *)(base + meta_off);
    c->inputs = (float *)(base + in_off);
    c->outputs = (float *)(base + out_off);
    c->first = lane * per;
    c->per = per;
    c->max_in = max_in;
    c->max_out = max_out;
    c->pid = pid;
    c->adaptive = fixed_spin_ns < 0;
    c->fixed_ns = fixed_spin_ns < 0 ? 0 : (uint64_t)fixed_spin_ns;
    c->spin_min_ns = spin_min_ns;
    c->spin_max_ns = spin_max_ns;
    c->hold_ns = c->adaptive ? spin_min_ns : c->fixed_ns;
    return c;
}

void kc_destroy(struct kc *c)
{
    if (c) {
        free(c->busy), free(c->t0), free(c->deadline), free(c->out);
        free(c);
    }
}

/* The answer buffer (struct kc_answer, then max_out floats): the caller keeps a view on it. */
void *kc_out(struct kc *c)
{
    return c->out;
}

/* ring.RingClient._learn: wait.py's rule on the recent waits for an answer. */
void kc_learn(struct kc *c, uint64_t waited_ns)
{
    if (!c->adaptive)
        return;
    if (waited_ns > 2 * c->spin_max_ns)
        waited_ns = 2 * c->spin_max_ns;
    uint64_t g = c->gap_ns - c->gap_ns / 8;
    c->gap_ns = g = waited_ns > g ? waited_ns : g;
    uint64_t h = 2 * g;
    c->hold_ns = g > c->spin_max_ns ? c->spin_min_ns : h < c->spin_min_ns ? c->spin_min_ns : h > c->spin_max_ns ? c->spin_max_ns : h;
}

/* out[0..3] = hold_ns, gap_ns, seq, next (for tests and the bench) */
void kc_state(struct kc *c, uint64_t *out)
{
    out[0] = c->hold_ns;
    out[1] = c->gap_ns;
    out[2] = c->seq;
    out[3] = c->next;
}

/* Publish one request of nbytes of float32 inputs; the slot, or a negative error. */
int kc_submit(struct kc *c, const void *data, int nbytes, int model_id)
{
    uint32_t n = (uint32_t)nbytes >> 2;
    if (nbytes < 0 || n > c->max_in)
        return KC_TOO_BIG;
    if (model_id < 0)
        return KC_BAD_MODEL_ID;
    uint32_t slot = UINT32_MAX;
    for (uint32_t k = 0; k < c->per; k++) {
        uint32_t i = (c->next + k) % c->per;
        uint32_t s = __atomic_load_n(&c->state[c->first + i], __ATOMIC_ACQUIRE);
        if (!c->busy[i] && (s == GPUOS_KINFER_FREE || s == GPUOS_KINFER_DONE)) {
            slot = c->first + i;
            c->next = (i + 1) % c->per;
            break;
        }
    }
    if (slot == UINT32_MAX)
        return KC_LANE_FULL;
    __atomic_store_n(&c->state[slot], GPUOS_KINFER_WRITING, __ATOMIC_RELAXED);
    struct gpuos_kinfer_meta *m = &c->meta[slot];
    c->seq++;
    m->version = GPUOS_KINFER_ENTRY_VERSION;
    m->model_id = (uint32_t)model_id;
    m->n_inputs = n;
    m->status = 0;
    m->seq = c->seq;
    m->submit_ns = now_ns();
    m->done_ns = 0;
    m->producer_pid = c->pid;
    m->waiting = 0;
    memcpy(c->inputs + (size_t)slot * c->max_in, data, 4ull * n);
    __atomic_store_n(&c->state[slot], GPUOS_KINFER_READY, __ATOMIC_RELEASE);
    __atomic_fetch_add(&c->h->doorbell, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->h->daemon_sleeping, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &c->h->doorbell, FUTEX_WAKE, 1, NULL, NULL, 0);
    c->busy[slot - c->first] = 1;
    return (int)slot;
}

/* The answer in slot (DONE): into c->out; returns n_outputs (bounded by max_outputs). */
static int read_answer(struct kc *c, uint32_t slot)
{
    struct gpuos_kinfer_meta *m = &c->meta[slot];
    struct kc_answer *a = c->out;
    c->busy[slot - c->first] = 0;
    a->status = m->status;
    a->decision = m->decision;
    a->batch = m->batch;
    a->where = m->where;
    a->latency_ns = (int64_t)(m->done_ns - m->submit_ns);
    uint32_t n = m->n_outputs;
    if (n > c->max_out)
        n = c->max_out;
    memcpy(a->values, c->outputs + (size_t)slot * c->max_out, 4ull * n);
    return (int)n;
}

/* Wait for the answer in slot. fresh: a new wait (its clock and timeout start now, the spin first);
 * otherwise the continuation of one that returned KC_AGAIN. Returns n_outputs with the answer in
 * c->out, KC_AGAIN after a sleep slice without it, KC_TIMEOUT (out->status = the slot's state); on
 * both of these out->batch = the slot. */
int kc_wait(struct kc *c, int slot_, double timeout_s, int fresh)
{
    uint32_t slot = (uint32_t)slot_;
    if (slot_ < 0 || slot < c->first || slot >= c->first + c->per)
        return KC_BAD_SLOT;
    uint32_t i = slot - c->first, *st = &c->state[slot];
    if (fresh) {
        if (__atomic_load_n(st, __ATOMIC_ACQUIRE) == GPUOS_KINFER_DONE)
            return read_answer(c, slot); /* answered already: nothing waited, nothing learnt */
        uint64_t t0 = now_ns();
        c->t0[i] = t0;
        double left = timeout_s > 0 ? timeout_s * 1e9 : 0;
        c->deadline[i] = left >= 1.8e19 ? UINT64_MAX : t0 + (uint64_t)left;
        uint64_t spin_until = t0 + c->hold_ns;
        uint32_t spins = 0;
        for (;;) {
            if (__atomic_load_n(st, __ATOMIC_ACQUIRE) == GPUOS_KINFER_DONE) {
                kc_learn(c, now_ns() - t0);
                return read_answer(c, slot);
            }
            if (now_ns() >= spin_until)
                break;
            relax();
            /* now and then let another thread of this CPU run (the daemon, on a small machine) */
            if ((++spins & 63) == 0)
                sched_yield();
        }
    }
    struct gpuos_kinfer_meta *m = &c->meta[slot];
    uint32_t s = __atomic_load_n(st, __ATOMIC_SEQ_CST);
    if (s != GPUOS_KINFER_DONE) {
        uint64_t now = now_ns();
        if (now >= c->deadline[i]) {
            c->out->status = s;
            c->out->batch = slot;
            return KC_TIMEOUT;
        }
        __atomic_store_n(&m->waiting, 1, __ATOMIC_SEQ_CST);
        s = __atomic_load_n(st, __ATOMIC_SEQ_CST); /* re-check after announcing the sleep */
        if (s != GPUOS_KINFER_DONE) {
            uint64_t left = c->deadline[i] - now;
            if (left > KC_SLICE_NS)
                left = KC_SLICE_NS;
            struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
            syscall(SYS_futex, st, FUTEX_WAIT, s, &ts, NULL, 0);
            if (__atomic_load_n(st, __ATOMIC_ACQUIRE) != GPUOS_KINFER_DONE) {
                c->out->batch = slot;
                return KC_AGAIN;
            }
        }
    }
    __atomic_store_n(&m->waiting, 0, __ATOMIC_RELAXED);
    kc_learn(c, now_ns() - c->t0[i]);
    return read_answer(c, slot);
}

/* One request: kc_submit then kc_wait(fresh); what either returns. */
int kc_infer(struct kc *c, const void *data, int nbytes, int model_id, double timeout_s)
{
    int slot = kc_submit(c, data, nbytes, model_id);
    return slot < 0 ? slot : kc_wait(c, slot, timeout_s, 1);
}
