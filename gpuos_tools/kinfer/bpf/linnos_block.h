/* linnos_block.h: what the block-layer BPF program (linnos_block.bpf.c) tells its loader
 * (loader.c) through the BPF ring buffer `events`, and the program's counters.
 *
 * One struct gk_event per record, 112 bytes, little-endian:
 *   - kind GK_ISSUE: a read was issued to the device; features[] are LinnOS's 31 inputs,
 *     built in the kernel at that moment (done_ns = 0).
 *   - kind GK_COMPLETE: a read or a write completed; every field is set, features[] as they
 *     were at issue (zero for a write).
 * Times are CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns). `dev` is the whole disk's
 * number, major << 20 | minor (the kernel's dev_t). `pending` is what was in flight on that
 * disk when the request was issued, before it, in 4 KiB units (reads and writes).
 *
 * This header is included by BPF C (clang -target bpf) and by the loader (cc): plain
 * fixed-width types only.
 */
#ifndef GPUOS_LINNOS_BLOCK_H
#define GPUOS_LINNOS_BLOCK_H

#define GK_FEATURES 31
#define GK_HISTORY 4
#define GK_COMM_LEN 16

enum gk_kind { GK_ISSUE = 1, GK_COMPLETE = 2 };
enum gk_op { GK_READ = 0, GK_WRITE = 1 };

struct gk_event {
    unsigned long long issue_ns;  /*   0 */
    unsigned long long done_ns;   /*   8: 0 in an issue event */
    unsigned long long rq;        /*  16: the request's identity while it is in flight */
    unsigned long long sector;    /*  24: first 512-byte sector on the disk */
    unsigned int dev;             /*  32: major << 20 | minor of the disk */
    unsigned int bytes;           /*  36 */
    unsigned int pending;         /*  40: 4 KiB units in flight at issue, before this one */
    unsigned int pid;             /*  44: the submitting task (thread id) */
    unsigned int hwq;             /*  48: hardware queue the request went to */
    int error;                    /*  52: the completion's blk_status_t (0 = ok) */
    char comm[GK_COMM_LEN];       /*  56: the submitting task's name */
    unsigned char kind;           /*  72: enum gk_kind */
    unsigned char op;             /*  73: enum gk_op */
    unsigned char features[GK_FEATURES]; /* 74: one decimal digit each */
    unsigned char reserved[7];    /* 105 */
};

/* Indexes into the `counters` array map (per-CPU sums). */
enum gk_counter {
    GK_C_ISSUED = 0,       /* reads and writes seen at issue */
    GK_C_COMPLETED = 1,    /* completions matched to an issue */
    GK_C_UNTRACKED = 2,    /* completions of requests issued before the program was attached */
    GK_C_TABLE_FULL = 3,   /* requests not tracked: the in-flight table was full */
    GK_C_EVENTS_LOST = 4,  /* events not sent: the ring buffer was full */
    GK_C_REQUEUED = 5,     /* requests the driver gave back (issued again later) */
    GK_NCOUNTERS = 8,
};

/* The `config` array map, entry 0. */
struct gk_config {
    unsigned int only_listed; /* 1: only disks present in the `disks` map */
    unsigned int issue_events; /* 1: send GK_ISSUE events (the loader predicts); 0: completions only */
};

#endif
