// SPDX-License-Identifier: GPL-2.0-only OR Apache-2.0
/* linnos_block.bpf.c: LinnOS's inputs, computed in the kernel for every read a disk is given.
 *
 * Three block-layer tracepoints (BTF-enabled, so `struct request` is read directly and
 * relocated by libbpf against the running kernel's BTF: CO-RE):
 *   - block_io_start: a request got its first bio, in the submitting task: remember who.
 *   - block_rq_issue: the request goes to the device driver. Per disk, add its 4 KiB units to
 *     the in-flight count (the value before is this request's `pending`), and for a read build
 *     the 31 inputs from that count and the disk's last 4 completed reads; send a GK_ISSUE event.
 *   - block_rq_complete: take the request's units off the count, push a read's (pending,
 *     latency) into the disk's history, send a GK_COMPLETE event.
 * block_rq_requeue undoes an issue (the request will be issued again).
 *
 * Only reads and writes are tracked (flushes and discards are not I/O LinnOS counts). Per-disk
 * state is updated with atomic adds, no lock: two reads completing at once on two CPUs each
 * take their own history slot from one fetch-and-add; a reader may see a slot being rewritten,
 * a race of the same order as the one LinnOS's own kernel code accepts. Each slot is one
 * 64-bit word, so it is never seen half written.
 *
 * The types below are the few fields used, marked preserve_access_index: their offsets come
 * from the running kernel at load time, so one object runs on any kernel with BTF and these
 * tracepoints (block_io_start: 6.5 and later; the loader leaves it out on older kernels).
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "linnos_block.h"

struct gendisk {
    int major;
    int first_minor;
} __attribute__((preserve_access_index));

struct request_queue {
    struct gendisk *disk;
} __attribute__((preserve_access_index));

struct blk_mq_hw_ctx {
    unsigned int queue_num;
} __attribute__((preserve_access_index));

struct request {
    struct request_queue *q;
    struct blk_mq_hw_ctx *mq_hctx;
    unsigned int cmd_flags;
    unsigned int __data_len;
    unsigned long long __sector;
} __attribute__((preserve_access_index));

#define REQ_OP_MASK 0xff /* the low 8 bits of cmd_flags: enum req_op */
#define PAGE_UNITS_SHIFT 12
#define MAX_PENDING 999    /* 3 digits */
#define MAX_LATENCY_US 9999 /* 4 digits */

/* A request between io_start (or issue) and completion. */
struct inflight {
    __u64 issue_ns; /* 0 until issued */
    __u64 sector;
    __u32 dev;
    __u32 bytes;
    __u32 pending;
    __u32 pages;
    __u32 pid;
    __u32 hwq;
    __u8 op;
    __u8 features[GK_FEATURES];
    char comm[GK_COMM_LEN];
};

/* One disk: units in flight, and its last GK_HISTORY completed reads. */
struct disk {
    __s64 pending;
    __u64 reads_done;          /* history slot of the next completed read: reads_done % GK_HISTORY */
    __u64 history[GK_HISTORY]; /* pending at issue << 32 | latency in us */
};

struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 16384);
    __type(key, __u64);
    __type(value, struct inflight);
} inflight SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 256);
    __type(key, __u32);
    __type(value, struct disk);
} disks SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 64);
    __type(key, __u32);
    __type(value, __u32);
} wanted SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct gk_config);
} config SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, GK_NCOUNTERS);
    __type(key, __u32);
    __type(value, __u64);
} counters SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, 4 << 20);
} events SEC(".maps");

static __always_inline void count(__u32 which)
{
    __u64 *c = bpf_map_lookup_elem(&counters, &which);
    if (c)
        *c += 1; /* per-CPU: no other writer */
}

static __always_inline struct gk_config *settings(void)
{
    __u32 zero = 0;
    return bpf_map_lookup_elem(&config, &zero);
}

static __always_inline __u32 disk_of(struct request *rq)
{
    struct gendisk *g = rq->q->disk;
    if (!g)
        return 0;
    return ((__u32)g->major << 20) | (__u32)g->first_minor;
}

/* Is this disk one to watch (all, unless the loader listed some)? */
static __always_inline int watched(__u32 dev, struct gk_config *cfg)
{
    if (!dev)
        return 0;
    if (cfg && cfg->only_listed)
        return bpf_map_lookup_elem(&wanted, &dev) != 0;
    return 1;
}

static __always_inline struct disk *disk_state(__u32 dev)
{
    struct disk *d = bpf_map_lookup_elem(&disks, &dev);
    if (d)
        return d;
    struct disk fresh = {};
    bpf_map_update_elem(&disks, &dev, &fresh, BPF_NOEXIST);
    return bpf_map_lookup_elem(&disks, &dev);
}

static __always_inline void put_digits(__u8 *out, __u32 value, int width)
{
    /* most significant first; width is a constant at every call, so the loop unrolls */
    for (int i = width - 1; i >= 0; i--) {
        out[i] = value % 10;
        value /= 10;
    }
}

static __always_inline __u32 clamp(__u64 v, __u32 most)
{
    return v > most ? most : (__u32)v;
}

SEC("tp_btf/block_io_start")
int BPF_PROG(on_io_start, struct request *rq)
{
    __u32 op = rq->cmd_flags & REQ_OP_MASK;
    if (op != GK_READ && op != GK_WRITE)
        return 0;
    __u32 dev = disk_of(rq);
    if (!watched(dev, settings()))
        return 0;
    __u64 key = (__u64)rq;
    struct inflight v = {};
    v.pid = (__u32)bpf_get_current_pid_tgid();
    bpf_get_current_comm(v.comm, sizeof v.comm);
    if (bpf_map_update_elem(&inflight, &key, &v, BPF_ANY))
        count(GK_C_TABLE_FULL);
    return 0;
}

SEC("tp_btf/block_rq_issue")
int BPF_PROG(on_issue, struct request *rq)
{
    __u32 op = rq->cmd_flags & REQ_OP_MASK;
    if (op != GK_READ && op != GK_WRITE)
        return 0;
    struct gk_config *cfg = settings();
    __u32 dev = disk_of(rq);
    if (!watched(dev, cfg))
        return 0;
    struct disk *d = disk_state(dev);
    if (!d)
        return 0;
    __u64 key = (__u64)rq;
    struct inflight *v = bpf_map_lookup_elem(&inflight, &key);
    if (!v) { /* no io_start seen (older kernel, or a request without a bio): the task now */
        struct inflight fresh = {};
        fresh.pid = (__u32)bpf_get_current_pid_tgid();
        bpf_get_current_comm(fresh.comm, sizeof fresh.comm);
        if (bpf_map_update_elem(&inflight, &key, &fresh, BPF_ANY)) {
            count(GK_C_TABLE_FULL);
            return 0;
        }
        v = bpf_map_lookup_elem(&inflight, &key);
        if (!v)
            return 0;
    }
    if (v->issue_ns) /* issued twice without a requeue in between: keep the first */
        return 0;
    __u32 bytes = rq->__data_len;
    __u32 pages = (bytes + (1u << PAGE_UNITS_SHIFT) - 1) >> PAGE_UNITS_SHIFT;
    __s64 before = __sync_fetch_and_add(&d->pending, (__s64)pages);
    v->issue_ns = bpf_ktime_get_ns();
    v->sector = rq->__sector;
    v->dev = dev;
    v->bytes = bytes;
    v->pages = pages;
    v->pending = before > 0 ? (__u32)before : 0;
    v->hwq = rq->mq_hctx ? rq->mq_hctx->queue_num : 0;
    v->op = (__u8)op;
    count(GK_C_ISSUED);
    if (op != GK_READ)
        return 0;

    put_digits(&v->features[0], clamp(v->pending, MAX_PENDING), 3);
    __u64 done = d->reads_done;
    for (int j = 0; j < GK_HISTORY; j++) {
        __u64 h = 0;
        if (done > (__u64)j)
            h = d->history[(done - 1 - j) % GK_HISTORY];
        put_digits(&v->features[3 + 3 * j], clamp(h >> 32, MAX_PENDING), 3);
        put_digits(&v->features[3 + 3 * GK_HISTORY + 4 * j], clamp(h & 0xffffffffu, MAX_LATENCY_US), 4);
    }
    if (!cfg || !cfg->issue_events)
        return 0;
    struct gk_event *e = bpf_ringbuf_reserve(&events, sizeof *e, 0);
    if (!e) {
        count(GK_C_EVENTS_LOST);
        return 0;
    }
    e->issue_ns = v->issue_ns;
    e->done_ns = 0;
    e->rq = key;
    e->sector = v->sector;
    e->dev = dev;
    e->bytes = bytes;
    e->pending = v->pending;
    e->pid = v->pid;
    e->hwq = v->hwq;
    e->error = 0;
    __builtin_memcpy(e->comm, v->comm, sizeof e->comm);
    e->kind = GK_ISSUE;
    e->op = GK_READ;
    __builtin_memcpy(e->features, v->features, sizeof e->features);
    bpf_ringbuf_submit(e, 0);
    return 0;
}

SEC("tp_btf/block_rq_requeue")
int BPF_PROG(on_requeue, struct request *rq)
{
    __u64 key = (__u64)rq;
    struct inflight *v = bpf_map_lookup_elem(&inflight, &key);
    if (!v || !v->issue_ns)
        return 0;
    struct disk *d = bpf_map_lookup_elem(&disks, &v->dev);
    if (d)
        __sync_fetch_and_add(&d->pending, -(__s64)v->pages);
    v->issue_ns = 0;
    count(GK_C_REQUEUED);
    return 0;
}

SEC("tp_btf/block_rq_complete")
int BPF_PROG(on_complete, struct request *rq, int error, unsigned int nr_bytes)
{
    __u64 key = (__u64)rq;
    struct inflight *v = bpf_map_lookup_elem(&inflight, &key);
    if (!v || !v->issue_ns) {
        if (!v && watched(disk_of(rq), settings()))
            count(GK_C_UNTRACKED);
        return 0;
    }
    __u64 now = bpf_ktime_get_ns();
    __u64 lat_us = (now - v->issue_ns) / 1000;
    struct disk *d = bpf_map_lookup_elem(&disks, &v->dev);
    if (d) {
        __sync_fetch_and_add(&d->pending, -(__s64)v->pages);
        if (v->op == GK_READ) {
            __u64 slot = __sync_fetch_and_add(&d->reads_done, 1);
            d->history[slot % GK_HISTORY] = ((__u64)v->pending << 32) | clamp(lat_us, 0xffffffffu);
        }
    }
    count(GK_C_COMPLETED);
    struct gk_event *e = bpf_ringbuf_reserve(&events, sizeof *e, 0);
    if (!e) {
        count(GK_C_EVENTS_LOST);
    } else {
        e->issue_ns = v->issue_ns;
        e->done_ns = now;
        e->rq = key;
        e->sector = v->sector;
        e->dev = v->dev;
        e->bytes = v->bytes;
        e->pending = v->pending;
        e->pid = v->pid;
        e->hwq = v->hwq;
        e->error = error;
        __builtin_memcpy(e->comm, v->comm, sizeof e->comm);
        e->kind = GK_COMPLETE;
        e->op = v->op;
        __builtin_memcpy(e->features, v->features, sizeof e->features);
        bpf_ringbuf_submit(e, 0);
    }
    bpf_map_delete_elem(&inflight, &key);
    return 0;
}

/* The kernel lets only programs under a GPL-compatible license read its structures (the verifier
 * refuses "Apache-2.0": "Cannot access kernel 'struct request' from non-GPL compatible
 * program"); this file is offered under GPL-2.0 as well, and declared so. */
char LICENSE[] SEC("license") = "GPL";
