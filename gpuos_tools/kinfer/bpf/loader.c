/* loader.c: loads linnos_block.bpf.o with libbpf (CO-RE against the running kernel's BTF),
 * attaches its tracepoints and runs one thread that
 *   - consumes the program's ring buffer (struct gk_event, linnos_block.h);
 *   - for each read issued, when a gpu-kinfer-bridge ring is attached, sends its 31 kernel-side
 *     inputs to the daemon as a C producer (gpuos_kinfer.h) and notes the answer when it comes;
 *   - for each completion, joins the request's issue, the daemon's answer and its latency into
 *     one struct gk_record and queues it for the Python side (gk_take).
 * Built once with the system C compiler and -lbpf (gpuos_tools/kinfer/bpf/loader.py), used
 * through ctypes. (One unit, over 800 lines: libbpf's objects, the ring-buffer thread and the
 * producer's lanes share static state behind one thread; the BPF program itself is apart.)
 *
 * Waiting: the thread polls the ring buffer and its outstanding answers while events are
 * recent (an adaptive window, as the daemon's: gpuos_tools/kinfer/wait.py), then sleeps in
 * ring_buffer__poll (epoll) until the kernel signals new data.
 *
 * Nothing here blocks on the daemon: a read for which no slot of the claimed lanes is free is
 * recorded unpredicted (counted), and a request whose answer does not come within
 * answer_timeout is recorded unpredicted too; its slot is reused only once the daemon
 * has answered it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/btf.h>
#include <bpf/libbpf.h>

#include "gpuos_kinfer.h"
#include "linnos_block.h"

#define GK_TABLE 16384          /* reads awaiting an answer or a completion (power of two) */
#define GK_QUEUE 65536          /* records waiting for the Python side (power of two) */
#define GK_MAX_SLOTS 256        /* slots of the lanes claimed */
#define GK_SWEEP_NS 100000000ull
#define GK_EXPIRE_NS 30000000000ull /* a read whose completion never came (lost event) */
#define GK_SLEEP_MS 100

/* What the Python side reads (loader.py mirrors it and checks every offset with gk_layout). */
struct gk_record {
    uint64_t issue_ns;   /* kernel: issued to the driver */
    uint64_t done_ns;    /* kernel: completed */
    uint64_t sector;
    uint64_t seen_ns;    /* loader: the issue event read from the ring buffer */
    uint64_t submit_ns;  /* loader: the request written into the kinfer ring */
    uint64_t answer_ns;  /* loader: the daemon's answer seen */
    uint64_t decided_ns; /* daemon: the answer written (its done_ns) */
    uint32_t dev, bytes, pending, pid, hwq;
    int32_t error;
    int32_t decision;    /* the daemon's decision (1 = slow), -1 when not predicted */
    uint32_t batch, where, status;
    char comm[GK_COMM_LEN];
    uint8_t op;
    uint8_t predicted;   /* enum gk_predicted */
    uint8_t features[GK_FEATURES];
    uint8_t reserved[7];
};

enum gk_predicted {
    GK_P_NONE = 0,     /* a write, or no daemon attached */
    GK_P_ANSWERED = 1,
    GK_P_NO_SLOT = 2,  /* every slot of the claimed lanes was in flight */
    GK_P_TIMEOUT = 3,  /* no answer within answer_timeout */
    GK_P_NO_ISSUE = 4, /* the issue event was not seen (attached mid-flight, or lost) */
    GK_P_REFUSED = 5,  /* the daemon answered with an error status (see status) */
};

enum { E_ST_WAIT = 1, E_ST_ANSWERED = 2, E_ST_DONE_WAIT = 3 };

struct entry {
    uint64_t rq;   /* the read's key (key_of), 0: empty */
    uint64_t seq;  /* the kinfer request's seq, 0 when none was sent */
    uint32_t state;
    uint32_t slot;
    struct gk_record rec;
};

/* loader counters (gk_stats) */
enum {
    L_EVENTS, L_ISSUES, L_COMPLETIONS, L_PREDICTED, L_NO_SLOT, L_TIMEOUTS, L_QUEUE_LOST, L_EXPIRED,
    L_SLEEPS, L_REFUSED, L_NCOUNTERS = 12
};

struct gk {
    struct bpf_object *obj;
    struct bpf_link *links[4];
    int nlinks;
    struct ring_buffer *rb;
    int counters_fd, config_fd, wanted_fd, ncpus;
    /* the kinfer ring, when attached */
    int ring_fd;
    uint8_t *base;
    size_t size;
    struct gpuos_kinfer_header *h;
    uint32_t *state;
    struct gpuos_kinfer_meta *meta;
    float *inputs;
    uint32_t slots[GK_MAX_SLOTS]; /* ring slot numbers of the claimed lanes */
    uint64_t slot_seq[GK_MAX_SLOTS]; /* seq of the request in flight there, 0: free */
    uint64_t slot_rq[GK_MAX_SLOTS];  /* the read it was sent for */
    uint64_t slot_t[GK_MAX_SLOTS];
    uint8_t slot_late[GK_MAX_SLOTS]; /* its read stopped waiting (answer_timeout) */
    uint32_t nslots, next_slot, model_id, lanes_claimed, outstanding;
    uint64_t seq, answer_timeout_ns;
    /* reads between issue and answer/completion */
    struct entry *table;
    uint32_t entries;
    /* records for Python */
    struct gk_record *queue;
    uint64_t qhead, qtail;
    uint32_t qbell;
    /* waiting */
    uint64_t spin_min_ns, spin_max_ns, gap_ns, last_event_ns;
    uint64_t next_sweep;
    int stop, running;
    pthread_t thread;
    uint64_t counters[L_NCOUNTERS];
};

static char last_error[1024];

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
}

/* libbpf's messages: kept (the verifier's last lines) to explain a failed load */
static char libbpf_log[8192];
static size_t libbpf_log_len;

static int on_libbpf_print(enum libbpf_print_level level, const char *fmt, va_list ap)
{
    if (level == LIBBPF_DEBUG)
        return 0;
    char line[1024];
    int n = vsnprintf(line, sizeof line, fmt, ap);
    if (n <= 0)
        return 0;
    size_t len = strlen(line);
    if (len >= sizeof libbpf_log)
        return 0;
    if (libbpf_log_len + len >= sizeof libbpf_log) { /* keep the end: the verifier's verdict is last */
        size_t drop = libbpf_log_len + len - sizeof libbpf_log + 1;
        memmove(libbpf_log, libbpf_log + drop, libbpf_log_len - drop);
        libbpf_log_len -= drop;
    }
    memcpy(libbpf_log + libbpf_log_len, line, len);
    libbpf_log_len += len;
    libbpf_log[libbpf_log_len] = 0;
    return 0;
}

static void futex_wake_private(uint32_t *addr)
{
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* -- the table of reads in flight ------------------------------------------------------------ */

/* A read's key: its request's address and issue time. The kernel reuses a request as soon as
 * it completes, often before the daemon's answer for the previous read in it has come. */
static uint64_t key_of(uint64_t rq, uint64_t issue_ns)
{
    uint64_t key = rq * 0x9e3779b97f4a7c15ull ^ issue_ns;
    return key ? key : 1;
}

static uint32_t hash_rq(uint64_t rq)
{
    rq ^= rq >> 33;
    rq *= 0xff51afd7ed558ccdull;
    rq ^= rq >> 33;
    return (uint32_t)rq & (GK_TABLE - 1);
}

static struct entry *find(struct gk *k, uint64_t rq)
{
    for (uint32_t i = hash_rq(rq), n = 0; n < GK_TABLE; i = (i + 1) & (GK_TABLE - 1), n++) {
        if (k->table[i].rq == rq)
            return &k->table[i];
        if (k->table[i].rq == 0)
            return NULL;
    }
    return NULL;
}

static struct entry *insert(struct gk *k, uint64_t rq)
{
    struct entry *e = find(k, rq);
    if (e)
        return e; /* the same read again (a lost event): start it over */
    if (k->entries >= GK_TABLE * 3 / 4)
        return NULL;
    for (uint32_t i = hash_rq(rq);; i = (i + 1) & (GK_TABLE - 1)) {
        if (k->table[i].rq == 0) {
            memset(&k->table[i], 0, sizeof k->table[i]);
            k->table[i].rq = rq;
            k->entries++;
            return &k->table[i];
        }
    }
}

/* Linear probing without tombstones: shift later members of the cluster back. */
static void erase(struct gk *k, struct entry *e)
{
    uint32_t i = (uint32_t)(e - k->table);
    k->table[i].rq = 0;
    k->entries--;
    for (uint32_t j = (i + 1) & (GK_TABLE - 1); k->table[j].rq; j = (j + 1) & (GK_TABLE - 1)) {
        uint32_t home = hash_rq(k->table[j].rq);
        /* move j to i when i lies cyclically in [home, j) */
        if (((j - home) & (GK_TABLE - 1)) >= ((j - i) & (GK_TABLE - 1))) {
            k->table[i] = k->table[j];
            k->table[j].rq = 0;
            i = j;
        }
    }
}

/* -- records for the Python side -------------------------------------------------------------- */

static void emit(struct gk *k, const struct gk_record *r)
{
    uint64_t head = k->qhead, tail = __atomic_load_n(&k->qtail, __ATOMIC_ACQUIRE);
    if (head - tail >= GK_QUEUE) {
        k->counters[L_QUEUE_LOST]++;
        return;
    }
    k->queue[head & (GK_QUEUE - 1)] = *r;
    __atomic_store_n(&k->qhead, head + 1, __ATOMIC_RELEASE);
    __atomic_fetch_add(&k->qbell, 1, __ATOMIC_SEQ_CST);
    futex_wake_private(&k->qbell);
}

/* -- the kinfer ring ------------------------------------------------------------------------- */

static int lock_byte(int fd, long long where)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = where;
    fl.l_len = 1;
    return fcntl(fd, F_SETLK, &fl);
}

/* The read slot i was sent for, if it still waits for that answer. */
static struct entry *reader_of(struct gk *k, uint32_t i)
{
    struct entry *e = find(k, k->slot_rq[i]);
    return e && e->seq == k->slot_seq[i] ? e : NULL;
}

static void answer_seen(struct gk *k, uint32_t i, uint64_t now)
{
    struct gpuos_kinfer_meta *m = &k->meta[k->slots[i]];
    struct entry *e = k->slot_late[i] ? NULL : reader_of(k, i);
    k->slot_seq[i] = 0;
    k->slot_late[i] = 0;
    k->outstanding--;
    if (!e)
        return;
    int ok = m->status == GPUOS_KINFER_OK;
    e->seq = 0;
    e->rec.answer_ns = now;
    e->rec.decided_ns = m->done_ns;
    e->rec.status = m->status;
    e->rec.decision = ok ? m->decision : -1;
    e->rec.batch = m->batch;
    e->rec.where = m->where;
    e->rec.predicted = ok ? GK_P_ANSWERED : GK_P_REFUSED;
    k->counters[ok ? L_PREDICTED : L_REFUSED]++;
    if (e->state == E_ST_DONE_WAIT) {
        emit(k, &e->rec);
        erase(k, e);
    } else {
        e->state = E_ST_ANSWERED;
    }
}

/* Check the slots in flight for answers; returns how many came. */
static int poll_answers(struct gk *k)
{
    if (!k->outstanding)
        return 0;
    int got = 0;
    for (uint32_t i = 0; i < k->nslots; i++) {
        if (!k->slot_seq[i])
            continue;
        if (__atomic_load_n(&k->state[k->slots[i]], __ATOMIC_ACQUIRE) == GPUOS_KINFER_DONE) {
            answer_seen(k, i, now_ns()); /* the time after this slot's DONE was seen, never before the daemon's done_ns */
            got++;
        }
    }
    return got;
}

static int free_slot(struct gk *k)
{
    for (uint32_t n = 0; n < k->nslots; n++) {
        uint32_t i = (k->next_slot + n) % k->nslots;
        if (k->slot_seq[i])
            continue;
        uint32_t st = __atomic_load_n(&k->state[k->slots[i]], __ATOMIC_ACQUIRE);
        if (st == GPUOS_KINFER_FREE || st == GPUOS_KINFER_DONE) {
            k->next_slot = (i + 1) % k->nslots;
            return (int)i;
        }
    }
    return -1;
}

static int submit(struct gk *k, struct entry *e)
{
    int i = free_slot(k);
    if (i < 0) {
        poll_answers(k);
        i = free_slot(k);
    }
    if (i < 0)
        return -1;
    uint32_t s = k->slots[i];
    struct gpuos_kinfer_meta *m = &k->meta[s];
    uint64_t t = now_ns();
    __atomic_store_n(&k->state[s], GPUOS_KINFER_WRITING, __ATOMIC_RELAXED);
    m->version = GPUOS_KINFER_ENTRY_VERSION;
    m->model_id = k->model_id;
    m->n_inputs = GK_FEATURES;
    m->status = 0;
    m->seq = ++k->seq;
    m->submit_ns = t;
    m->done_ns = 0;
    m->producer_pid = (uint32_t)getpid();
    m->waiting = 0; /* never set: this thread polls, it does not sleep on a slot */
    float *x = k->inputs + (size_t)s * k->h->max_inputs;
    for (int j = 0; j < GK_FEATURES; j++)
        x[j] = (float)e->rec.features[j];
    __atomic_store_n(&k->state[s], GPUOS_KINFER_READY, __ATOMIC_RELEASE);
    __atomic_fetch_add(&k->h->doorbell, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&k->h->daemon_sleeping, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &k->h->doorbell, FUTEX_WAKE, 1, NULL, NULL, 0);
    k->slot_seq[i] = k->seq;
    k->slot_rq[i] = e->rq;
    k->slot_late[i] = 0;
    k->slot_t[i] = t;
    k->outstanding++;
    e->seq = k->seq;
    e->slot = (uint32_t)i;
    e->rec.submit_ns = t;
    return 0;
}

/* -- events ---------------------------------------------------------------------------------- */

static void fill(struct gk_record *r, const struct gk_event *ev)
{
    r->issue_ns = ev->issue_ns;
    r->sector = ev->sector;
    r->dev = ev->dev;
    r->bytes = ev->bytes;
    r->pending = ev->pending;
    r->pid = ev->pid;
    r->hwq = ev->hwq;
    r->op = ev->op;
    memcpy(r->comm, ev->comm, sizeof r->comm);
    memcpy(r->features, ev->features, sizeof r->features);
}

static int on_event(void *ctx, void *data, size_t size)
{
    struct gk *k = ctx;
    const struct gk_event *ev = data;
    if (size < sizeof *ev)
        return 0;
    k->counters[L_EVENTS]++;
    if (ev->kind == GK_ISSUE) {
        k->counters[L_ISSUES]++;
        if (!k->h)
            return 0;
        struct entry *e = insert(k, key_of(ev->rq, ev->issue_ns));
        if (!e)
            return 0; /* table full: its completion is recorded unpredicted */
        e->seq = 0;
        memset(&e->rec, 0, sizeof e->rec);
        fill(&e->rec, ev);
        e->rec.seen_ns = now_ns();
        e->rec.decision = -1;
        e->state = E_ST_WAIT;
        if (submit(k, e) < 0) {
            k->counters[L_NO_SLOT]++;
            e->rec.predicted = GK_P_NO_SLOT;
            e->state = E_ST_ANSWERED; /* nothing to wait for but the completion */
        }
        return 0;
    }
    if (ev->kind != GK_COMPLETE)
        return 0;
    k->counters[L_COMPLETIONS]++;
    struct entry *e = k->h && ev->op == GK_READ ? find(k, key_of(ev->rq, ev->issue_ns)) : NULL;
    if (e && e->rec.issue_ns != ev->issue_ns)
        e = NULL; /* an entry of an earlier request at this address */
    if (!e) {
        struct gk_record r;
        memset(&r, 0, sizeof r);
        fill(&r, ev);
        r.done_ns = ev->done_ns;
        r.error = ev->error;
        r.decision = -1;
        r.predicted = k->h && ev->op == GK_READ ? GK_P_NO_ISSUE : GK_P_NONE;
        emit(k, &r);
        return 0;
    }
    e->rec.done_ns = ev->done_ns;
    e->rec.error = ev->error;
    if (e->state == E_ST_WAIT) {
        e->state = E_ST_DONE_WAIT; /* recorded once the answer comes (or times out) */
    } else {
        emit(k, &e->rec);
        erase(k, e);
    }
    return 0;
}

/* Answers overdue and reads whose completion never came. */
static void sweep(struct gk *k, uint64_t now)
{
    for (uint32_t i = 0; i < k->nslots; i++) {
        if (!k->slot_seq[i] || k->slot_late[i] || now - k->slot_t[i] < k->answer_timeout_ns)
            continue;
        k->slot_late[i] = 1; /* the slot stays busy until the daemon answers; its read no longer waits */
        struct entry *e = reader_of(k, i);
        if (!e)
            continue;
        k->counters[L_TIMEOUTS]++;
        e->seq = 0;
        e->rec.predicted = GK_P_TIMEOUT;
        if (e->state == E_ST_DONE_WAIT) {
            emit(k, &e->rec);
            erase(k, e);
        } else {
            e->state = E_ST_ANSWERED;
        }
    }
    for (uint32_t j = 0; j < GK_TABLE; j++) {
        struct entry *e = &k->table[j];
        if (e->rq && e->state == E_ST_ANSWERED && now - e->rec.seen_ns > GK_EXPIRE_NS) {
            k->counters[L_EXPIRED]++;
            erase(k, e);
            j--; /* erase may have moved another entry here */
        }
    }
}

/* The adaptive window (gpuos_tools/kinfer/wait.py says why): how long to keep polling after
 * the last event before sleeping in epoll. */
static uint64_t hold_ns(struct gk *k)
{
    uint64_t g = k->gap_ns;
    if (g == 0 || g > k->spin_max_ns)
        return k->spin_min_ns;
    uint64_t h = 2 * g;
    return h < k->spin_min_ns ? k->spin_min_ns : h > k->spin_max_ns ? k->spin_max_ns : h;
}

static void note_traffic(struct gk *k, uint64_t now)
{
    if (k->last_event_ns) {
        uint64_t gap = now - k->last_event_ns;
        if (gap > 2 * k->spin_max_ns)
            gap = 2 * k->spin_max_ns;
        uint64_t decayed = k->gap_ns - k->gap_ns / 8;
        k->gap_ns = gap > decayed ? gap : decayed;
    }
    k->last_event_ns = now;
}

static void *loop(void *arg)
{
    struct gk *k = arg;
    uint32_t spins = 0;
    uint64_t last_turn = now_ns();
    while (!__atomic_load_n(&k->stop, __ATOMIC_ACQUIRE)) {
        int n = ring_buffer__consume(k->rb);
        int answers = poll_answers(k);
        uint64_t now = now_ns();
        if (now - last_turn > 50000ull) /* descheduled, not idle: as the daemon's loop */
            k->last_event_ns += now - last_turn;
        last_turn = now;
        if (n > 0)
            note_traffic(k, now);
        if (now >= k->next_sweep) {
            sweep(k, now);
            k->next_sweep = now + GK_SWEEP_NS;
        }
        if (n > 0 || answers > 0)
            continue;
        if (k->outstanding) { /* the daemon may need this very CPU to answer: offer it */
            sched_yield();
            continue;
        }
        if (now - k->last_event_ns < hold_ns(k)) {
            relax();
            if ((++spins & 15) == 0)
                sched_yield();
            continue;
        }
        k->counters[L_SLEEPS]++;
        ring_buffer__poll(k->rb, GK_SLEEP_MS); /* handles what it finds, like consume */
        uint64_t after = now_ns();
        last_turn = after;
        if (after - now < (uint64_t)GK_SLEEP_MS * 1000000ull)
            note_traffic(k, after);
    }
    return NULL;
}

/* -- the interface Python calls (ctypes) ------------------------------------------------------- */

const char *gk_error(void) { return last_error; }

/* sizeof(struct gk_record) then the offset of each field, in declaration order */
int gk_layout(uint32_t *out, int n)
{
    const uint32_t v[] = {
        sizeof(struct gk_record),
        __builtin_offsetof(struct gk_record, issue_ns), __builtin_offsetof(struct gk_record, done_ns),
        __builtin_offsetof(struct gk_record, sector), __builtin_offsetof(struct gk_record, seen_ns),
        __builtin_offsetof(struct gk_record, submit_ns), __builtin_offsetof(struct gk_record, answer_ns),
        __builtin_offsetof(struct gk_record, decided_ns), __builtin_offsetof(struct gk_record, dev), __builtin_offsetof(struct gk_record, bytes),
        __builtin_offsetof(struct gk_record, pending), __builtin_offsetof(struct gk_record, pid),
        __builtin_offsetof(struct gk_record, hwq), __builtin_offsetof(struct gk_record, error),
        __builtin_offsetof(struct gk_record, decision), __builtin_offsetof(struct gk_record, batch),
        __builtin_offsetof(struct gk_record, where), __builtin_offsetof(struct gk_record, status),
        __builtin_offsetof(struct gk_record, comm), __builtin_offsetof(struct gk_record, op),
        __builtin_offsetof(struct gk_record, predicted), __builtin_offsetof(struct gk_record, features),
    };
    int count = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < count; i++)
        out[i] = v[i];
    return count;
}

static int kernel_has(const char *typedef_name)
{
    struct btf *vmlinux = btf__load_vmlinux_btf();
    if (!vmlinux)
        return -1;
    int found = btf__find_by_name_kind(vmlinux, typedef_name, BTF_KIND_TYPEDEF) > 0;
    btf__free(vmlinux);
    return found;
}

void gk_close(struct gk *k);

/* Open and load the object, not yet attached. issue_events: send reads' issue events (needed to
 * predict); disks/ndisks: watch only these (major << 20 | minor), none = every disk. */
struct gk *gk_open(const char *object_path, int issue_events, const uint32_t *disks, int ndisks)
{
    libbpf_set_print(on_libbpf_print);
    libbpf_log_len = 0;
    libbpf_log[0] = 0;
    struct gk *k = calloc(1, sizeof *k);
    if (!k) {
        set_error("out of memory");
        return NULL;
    }
    k->ring_fd = -1;
    k->counters_fd = k->config_fd = k->wanted_fd = -1;
    k->table = calloc(GK_TABLE, sizeof *k->table);
    k->queue = calloc(GK_QUEUE, sizeof *k->queue);
    k->spin_min_ns = 50000;
    k->spin_max_ns = 5000000;
    k->answer_timeout_ns = 1000000000ull;
    if (!k->table || !k->queue) {
        set_error("out of memory");
        gk_close(k);
        return NULL;
    }
    k->obj = bpf_object__open_file(object_path, NULL);
    if (!k->obj) {
        set_error("%s: cannot open the BPF object: %s", object_path, strerror(errno));
        gk_close(k);
        return NULL;
    }
    int has_io_start = kernel_has("btf_trace_block_io_start");
    if (has_io_start < 0) {
        set_error("no kernel BTF (/sys/kernel/btf/vmlinux): the kernel needs CONFIG_DEBUG_INFO_BTF for CO-RE programs");
        gk_close(k);
        return NULL;
    }
    if (!has_io_start) {
        struct bpf_program *p = bpf_object__find_program_by_name(k->obj, "on_io_start");
        if (p)
            bpf_program__set_autoload(p, false);
    }
    int err = bpf_object__load(k->obj);
    if (err) {
        set_error("loading the BPF program failed (%s)%s%s", strerror(-err), libbpf_log_len ? ":\n" : "", libbpf_log);
        gk_close(k);
        return NULL;
    }
    struct bpf_map *m;
    k->counters_fd = (m = bpf_object__find_map_by_name(k->obj, "counters")) ? bpf_map__fd(m) : -1;
    k->config_fd = (m = bpf_object__find_map_by_name(k->obj, "config")) ? bpf_map__fd(m) : -1;
    k->wanted_fd = (m = bpf_object__find_map_by_name(k->obj, "wanted")) ? bpf_map__fd(m) : -1;
    int events_fd = (m = bpf_object__find_map_by_name(k->obj, "events")) ? bpf_map__fd(m) : -1;
    if (k->counters_fd < 0 || k->config_fd < 0 || k->wanted_fd < 0 || events_fd < 0) {
        set_error("%s: not the linnos_block program (a map is missing)", object_path);
        gk_close(k);
        return NULL;
    }
    struct gk_config cfg = {.only_listed = ndisks > 0, .issue_events = issue_events != 0};
    uint32_t zero = 0, one = 1;
    for (int i = 0; i < ndisks; i++)
        bpf_map_update_elem(k->wanted_fd, &disks[i], &one, BPF_ANY);
    bpf_map_update_elem(k->config_fd, &zero, &cfg, BPF_ANY);
    k->ncpus = libbpf_num_possible_cpus();
    k->rb = ring_buffer__new(events_fd, on_event, k, NULL);
    if (!k->rb) {
        set_error("ring buffer: %s", strerror(errno));
        gk_close(k);
        return NULL;
    }
    return k;
}

/* Become a producer on the kinfer ring at path: map it, claim up to `lanes` free lanes. */
int gk_attach_ring(struct gk *k, const char *path, uint32_t model_id, uint32_t lanes)
{
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        set_error("%s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size < sizeof(struct gpuos_kinfer_header)) {
        set_error("%s: too small for a ring", path);
        close(fd);
        return -1;
    }
    uint8_t *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        set_error("%s: mmap: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    struct gpuos_kinfer_header *h = (struct gpuos_kinfer_header *)base;
    if (h->magic != GPUOS_KINFER_MAGIC || h->version != GPUOS_KINFER_VERSION || h->header_size != GPUOS_KINFER_HEADER_SIZE ||
        h->meta_size != sizeof(struct gpuos_kinfer_meta) || h->total_size > (uint64_t)st.st_size || h->max_inputs < GK_FEATURES ||
        h->lanes == 0 || h->slots_per_lane == 0 || (uint64_t)h->lanes * h->slots_per_lane != h->nslots) {
        set_error("%s: not a gpu-kinfer-bridge ring of layout version %u with room for %d inputs", path, GPUOS_KINFER_VERSION,
                  GK_FEATURES);
        munmap(base, (size_t)st.st_size);
        close(fd);
        return -1;
    }
    uint32_t claimed = 0, n = 0;
    for (uint32_t lane = 0; lane < h->lanes && claimed < lanes && n + h->slots_per_lane <= GK_MAX_SLOTS; lane++) {
        if (lock_byte(fd, GPUOS_KINFER_LOCK_LANE0 + lane) < 0)
            continue;
        claimed++;
        for (uint32_t j = 0; j < h->slots_per_lane; j++) {
            uint32_t s = lane * h->slots_per_lane + j;
            uint32_t *word = (uint32_t *)(base + h->state_offset) + s;
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == GPUOS_KINFER_WRITING)
                __atomic_store_n(word, GPUOS_KINFER_FREE, __ATOMIC_RELEASE); /* left by a dead owner */
            k->slots[n++] = s;
        }
    }
    if (!claimed) {
        set_error("%s: no free lane (%u producers attached)", path, h->lanes);
        munmap(base, (size_t)st.st_size);
        close(fd);
        return -1;
    }
    k->ring_fd = fd;
    k->base = base;
    k->size = (size_t)st.st_size;
    k->h = h;
    k->state = (uint32_t *)(base + h->state_offset);
    k->meta = (struct gpuos_kinfer_meta *)(base + h->meta_offset);
    k->inputs = (float *)(base + h->inputs_offset);
    k->nslots = n;
    k->lanes_claimed = claimed;
    k->model_id = model_id;
    return (int)claimed;
}

/* The adaptive window's bounds (ns) and how long a read waits for its answer. */
void gk_set_wait(struct gk *k, uint64_t spin_min_ns, uint64_t spin_max_ns, uint64_t answer_timeout_ns)
{
    k->spin_min_ns = spin_min_ns;
    k->spin_max_ns = spin_max_ns < spin_min_ns ? spin_min_ns : spin_max_ns;
    k->answer_timeout_ns = answer_timeout_ns;
}

/* Attach the tracepoints and start the thread. */
int gk_start(struct gk *k)
{
    if (k->running)
        return 0;
    struct bpf_program *p;
    bpf_object__for_each_program(p, k->obj)
    {
        if (!bpf_program__autoload(p))
            continue;
        struct bpf_link *link = bpf_program__attach(p);
        if (!link) {
            set_error("attaching %s: %s%s%s", bpf_program__name(p), strerror(errno), libbpf_log_len ? ":\n" : "", libbpf_log);
            return -1;
        }
        k->links[k->nlinks++] = link;
    }
    __atomic_store_n(&k->stop, 0, __ATOMIC_RELEASE);
    k->last_event_ns = now_ns();
    int rc = pthread_create(&k->thread, NULL, loop, k);
    if (rc) {
        set_error("pthread_create: %s", strerror(rc));
        return -1;
    }
    k->running = 1;
    return 0;
}

/* Detach the tracepoints, let the thread read what is left, stop it. */
void gk_stop(struct gk *k)
{
    if (!k->running)
        return;
    for (int i = 0; i < k->nlinks; i++)
        bpf_link__destroy(k->links[i]);
    k->nlinks = 0;
    uint64_t deadline = now_ns() + 200000000ull; /* answers still in flight: a moment to arrive */
    while (k->outstanding && now_ns() < deadline)
        usleep(100);
    __atomic_store_n(&k->stop, 1, __ATOMIC_RELEASE);
    pthread_join(k->thread, NULL);
    k->running = 0;
    ring_buffer__consume(k->rb);
    poll_answers(k);
    /* what still waits for an answer: record it as it stands */
    for (uint32_t j = 0; j < GK_TABLE; j++) {
        struct entry *e = &k->table[j];
        if (e->rq && e->state == E_ST_DONE_WAIT) {
            e->rec.predicted = GK_P_TIMEOUT;
            k->counters[L_TIMEOUTS]++;
            emit(k, &e->rec);
            erase(k, e);
            j--;
        }
    }
    __atomic_fetch_add(&k->qbell, 1, __ATOMIC_SEQ_CST);
    futex_wake_private(&k->qbell);
}

/* Up to cap records, waiting at most timeout_ns for the first. Called without the GIL. */
uint32_t gk_take(struct gk *k, struct gk_record *out, uint32_t cap, uint64_t timeout_ns)
{
    uint64_t deadline = now_ns() + timeout_ns;
    for (;;) {
        uint32_t bell = __atomic_load_n(&k->qbell, __ATOMIC_SEQ_CST);
        uint64_t tail = k->qtail, head = __atomic_load_n(&k->qhead, __ATOMIC_ACQUIRE);
        if (head != tail) {
            uint64_t n = head - tail < cap ? head - tail : cap;
            for (uint64_t i = 0; i < n; i++)
                out[i] = k->queue[(tail + i) & (GK_QUEUE - 1)];
            __atomic_store_n(&k->qtail, tail + n, __ATOMIC_RELEASE);
            return (uint32_t)n;
        }
        uint64_t now = now_ns();
        if (now >= deadline)
            return 0;
        uint64_t left = deadline - now;
        struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
        syscall(SYS_futex, &k->qbell, FUTEX_WAIT_PRIVATE, bell, &ts, NULL, 0);
    }
}

/* The loader's counters (L_*), then the program's (GK_C_*, summed over CPUs). */
int gk_stats(struct gk *k, uint64_t *out, int n)
{
    int i = 0;
    for (; i < L_NCOUNTERS && i < n; i++)
        out[i] = __atomic_load_n(&k->counters[i], __ATOMIC_RELAXED);
    uint64_t *per = calloc((size_t)(k->ncpus > 0 ? k->ncpus : 1), sizeof *per);
    for (uint32_t c = 0; c < GK_NCOUNTERS && i < n; c++, i++) {
        uint64_t sum = 0;
        if (per && k->counters_fd >= 0 && bpf_map_lookup_elem(k->counters_fd, &c, per) == 0)
            for (int cpu = 0; cpu < k->ncpus; cpu++)
                sum += per[cpu];
        out[i] = sum;
    }
    free(per);
    return i;
}

/* lanes claimed, slots, slots in flight now */
void gk_ring_info(struct gk *k, uint32_t *out)
{
    out[0] = k->lanes_claimed;
    out[1] = k->nslots;
    out[2] = k->outstanding;
}

void gk_close(struct gk *k)
{
    if (!k)
        return;
    gk_stop(k);
    for (int i = 0; i < k->nlinks; i++)
        bpf_link__destroy(k->links[i]);
    if (k->rb)
        ring_buffer__free(k->rb);
    if (k->obj)
        bpf_object__close(k->obj);
    if (k->base)
        munmap(k->base, k->size);
    if (k->ring_fd >= 0)
        close(k->ring_fd); /* drops the lane locks */
    free(k->table);
    free(k->queue);
    free(k);
}
