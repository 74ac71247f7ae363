/* gpuos_kinfer.h: the shared-memory ring of gpu-kinfer-bridge, for producers written in C.
 *
 * The ring is one file, /dev/shm/<name> (shm_open(<name>)), created by `gpu-kinfer-bridge serve`,
 * mode 0600 unless the daemon's owner shares it on purpose (--mode, --group). A producer opens it
 * with O_NOFOLLOW and checks, before mapping it, that it is a regular file owned by the user it
 * trusts (its own uid, root, or the daemon's owner it was told) and that the header's sizes fit
 * the file: a ring someone else made could give any answer. Everything is little-endian, naturally aligned, x86-64 / aarch64 Linux. The file holds, in
 * order (offsets in the header, so a reader never computes them itself):
 *
 *   struct gpuos_kinfer_header       4096 bytes
 *   uint32_t state[nslots]           one word per slot; also the slot's futex word
 *   struct gpuos_kinfer_meta meta[nslots]
 *   float inputs[nslots][max_inputs]
 *   float outputs[nslots][max_outputs]
 *
 * Slots are grouped in lanes of slots_per_lane consecutive slots. A producer owns a lane while it
 * holds a POSIX record lock (fcntl F_SETLK, F_WRLCK) on byte GPUOS_KINFER_LOCK_LANE0 + lane of
 * the file; the kernel drops the lock when the producer dies, so a lane is never lost.
 * F_OFD_SETLK works too and is what the Python client uses: it lets several producers of one
 * process hold lanes, which F_SETLK's per-process locks do not. Within its lane a producer
 * uses any slot whose state is FREE or DONE. The daemon holds the lock on byte
 * GPUOS_KINFER_LOCK_DAEMON while it serves.
 *
 * One request:
 *   1. state[i] = WRITING; fill meta[i] (version = GPUOS_KINFER_ENTRY_VERSION, model_id,
 *      n_inputs, seq, producer_pid, submit_ns) and inputs[i][0..n_inputs).
 *   2. state[i] = READY with release order, then add 1 to header.doorbell (sequentially
 *      consistent) and, if header.daemon_sleeping, futex-wake header.doorbell.
 *   3. Wait until state[i] == DONE (acquire): spin a little, then set meta[i].waiting = 1,
 *      re-check, and futex-wait on state[i] while it is still READY or TAKEN.
 *   4. Read meta[i].status, decision, n_outputs and outputs[i]; the slot is free again.
 * The daemon marks a slot it has taken TAKEN, writes the answer, then stores DONE (release) and
 * wakes it when meta[i].waiting. A slot left WRITING by a process that no longer exists is
 * reclaimed by the daemon and counted (drops_abandoned). futex words are shared (not
 * FUTEX_PRIVATE_FLAG): the file is mapped by several processes.
 *
 * An entry whose version is not GPUOS_KINFER_ENTRY_VERSION is answered with status
 * BAD_VERSION, one whose n_inputs does not match the model with BAD_SIZE, an unknown model_id
 * with BAD_MODEL; each is counted in the header and never crashes the daemon.
 */
#ifndef GPUOS_KINFER_H
#define GPUOS_KINFER_H

#include <stdint.h>

#define GPUOS_KINFER_MAGIC 0x31524E49464B5047ULL /* "GPKINFR1" in little-endian bytes */
#define GPUOS_KINFER_VERSION 1u                  /* layout version of the whole file */
#define GPUOS_KINFER_ENTRY_VERSION 1u            /* version of one request entry */
#define GPUOS_KINFER_HEADER_SIZE 4096u

/* POSIX record-lock bytes (fcntl F_SETLK); beyond the end of the file, which is allowed. */
#define GPUOS_KINFER_LOCK_DAEMON (1LL << 40)
#define GPUOS_KINFER_LOCK_LANE0 ((1LL << 40) + 1)

enum gpuos_kinfer_state {
    GPUOS_KINFER_FREE = 0,
    GPUOS_KINFER_WRITING = 1,
    GPUOS_KINFER_READY = 2,
    GPUOS_KINFER_TAKEN = 3,
    GPUOS_KINFER_DONE = 4,
};

enum gpuos_kinfer_status {
    GPUOS_KINFER_OK = 0,
    GPUOS_KINFER_BAD_VERSION = 1,
    GPUOS_KINFER_BAD_SIZE = 2,
    GPUOS_KINFER_BAD_MODEL = 3,
    GPUOS_KINFER_BAD_VALUE = 4, /* NaN or infinite input */
};

enum gpuos_kinfer_where { GPUOS_KINFER_CPU = 0, GPUOS_KINFER_GPU = 1 };

/* Counters in header.counters[], written by the daemon only. */
enum gpuos_kinfer_counter {
    GPUOS_KINFER_C_SERVED = 0,
    GPUOS_KINFER_C_BATCHES = 1,
    GPUOS_KINFER_C_CPU_BATCHES = 2,
    GPUOS_KINFER_C_GPU_BATCHES = 3,
    GPUOS_KINFER_C_DROP_BAD_VERSION = 4,
    GPUOS_KINFER_C_DROP_BAD_SIZE = 5,
    GPUOS_KINFER_C_DROP_BAD_MODEL = 6,
    GPUOS_KINFER_C_DROP_BAD_VALUE = 7,
    GPUOS_KINFER_C_DROP_ABANDONED = 8,
    GPUOS_KINFER_C_DROP_BAD_STATE = 9,
    GPUOS_KINFER_C_REQUEUED = 10,
    GPUOS_KINFER_C_MODEL_SWAPS = 11,
    GPUOS_KINFER_C_SLEEPS = 12,
    GPUOS_KINFER_NCOUNTERS = 16,
};

struct gpuos_kinfer_header {
    uint64_t magic;            /*   0: GPUOS_KINFER_MAGIC */
    uint32_t version;          /*   8: GPUOS_KINFER_VERSION */
    uint32_t header_size;      /*  12: GPUOS_KINFER_HEADER_SIZE */
    uint32_t nslots;           /*  16: lanes * slots_per_lane */
    uint32_t lanes;            /*  20 */
    uint32_t slots_per_lane;   /*  24 */
    uint32_t max_inputs;       /*  28: floats per request */
    uint32_t max_outputs;      /*  32: floats per answer */
    uint32_t meta_size;        /*  36: sizeof(struct gpuos_kinfer_meta) */
    uint64_t total_size;       /*  40: bytes of the file */
    uint64_t state_offset;     /*  48 */
    uint64_t meta_offset;      /*  56 */
    uint64_t inputs_offset;    /*  64 */
    uint64_t outputs_offset;   /*  72 */
    uint32_t daemon_pid;       /*  80: 0 when no daemon has served yet */
    uint32_t daemon_epoch;     /*  84: +1 at each daemon start */
    uint64_t heartbeat_ns;     /*  88: CLOCK_MONOTONIC, refreshed by the daemon about every 100 ms */
    uint32_t model_generation; /*  96: +1 at each model swap */
    uint32_t reserved0[7];     /* 100 */
    uint32_t doorbell;         /* 128: futex word; producers add 1 after publishing */
    uint32_t daemon_sleeping;  /* 132: 1 while the daemon sleeps (or is about to) on doorbell */
    uint32_t reserved1[14];    /* 136 */
    uint64_t counters[GPUOS_KINFER_NCOUNTERS]; /* 192 */
    uint32_t control_seq;      /* 320: +1 by a controller after writing control_path */
    uint32_t control_ack;      /* 324: the daemon copies control_seq here once done */
    int32_t control_status;    /* 328: 0 swapped in, 1 unreadable model, 2 does not fit the ring, 3 not a regular
                                  file in a directory the daemon loads from, 4 timed out, 5 model id >= 64 */
    uint32_t control_model_id; /* 332: which model control_path replaces (0 = the default) */
    char control_path[256];    /* 336: model file to load (absolute, NUL-terminated) */
    uint8_t reserved3[GPUOS_KINFER_HEADER_SIZE - 592];
};

struct gpuos_kinfer_meta {
    uint32_t version;      /*  0: GPUOS_KINFER_ENTRY_VERSION, by the producer */
    uint32_t model_id;     /*  4: by the producer (0 = the profile's model) */
    uint32_t n_inputs;     /*  8: by the producer */
    uint32_t status;       /* 12: by the daemon, enum gpuos_kinfer_status */
    uint64_t seq;          /* 16: by the producer, any value; echoed in answer_seq */
    uint64_t submit_ns;    /* 24: by the producer, CLOCK_MONOTONIC (0 if not known) */
    uint64_t done_ns;      /* 32: by the daemon, CLOCK_MONOTONIC */
    uint32_t producer_pid; /* 40: by the producer */
    uint32_t waiting;      /* 44: 1 when the producer sleeps on state[i] */
    int32_t decision;      /* 48: by the daemon: argmax of the outputs */
    uint32_t n_outputs;    /* 52: by the daemon */
    uint32_t batch;        /* 56: by the daemon: size of the batch it ran in */
    uint32_t where;        /* 60: by the daemon, enum gpuos_kinfer_where */
    uint64_t answer_seq;   /* 64: by the daemon: meta.seq of the request answered */
    uint64_t reserved[7];  /* 72 */
};

/* The feature store (LAKE): /dev/shm/<name>, a header then `capacity` records of record_size
 * bytes: {uint64_t ts_ns; uint64_t seq; float values[n_fields];} padded to 8 bytes. Record k
 * lives at GPUOS_KINFER_FEATURES_HEADER_SIZE + (k % capacity) * record_size. A writer takes the
 * POSIX record lock on byte GPUOS_KINFER_LOCK_DAEMON exclusively, writes record write_index,
 * adds 1 to write_index, and unlocks; readers take it shared. */
#define GPUOS_KINFER_FEATURES_MAGIC 0x31544145464B5047ULL /* "GPKFEAT1" */
#define GPUOS_KINFER_FEATURES_VERSION 1u
#define GPUOS_KINFER_FEATURES_HEADER_SIZE 4096u
#define GPUOS_KINFER_FEATURES_MAX_FIELDS 64
#define GPUOS_KINFER_FEATURES_NAME_LEN 48

struct gpuos_kinfer_features {
    uint64_t magic;        /*  0 */
    uint32_t version;      /*  8 */
    uint32_t n_fields;     /* 12 */
    uint32_t capacity;     /* 16: records */
    uint32_t record_size;  /* 20: 16 + 4 * n_fields rounded up to 8 */
    uint64_t write_index;  /* 24: records ever written */
    char schema[GPUOS_KINFER_FEATURES_NAME_LEN];                                     /* 32 */
    char fields[GPUOS_KINFER_FEATURES_MAX_FIELDS][GPUOS_KINFER_FEATURES_NAME_LEN];   /* 80 */
    uint8_t reserved[GPUOS_KINFER_FEATURES_HEADER_SIZE - 80 - GPUOS_KINFER_FEATURES_MAX_FIELDS * GPUOS_KINFER_FEATURES_NAME_LEN];
};

#ifdef __cplusplus
static_assert(sizeof(struct gpuos_kinfer_header) == GPUOS_KINFER_HEADER_SIZE, "header size");
static_assert(sizeof(struct gpuos_kinfer_meta) == 128, "meta size");
static_assert(sizeof(struct gpuos_kinfer_features) == GPUOS_KINFER_FEATURES_HEADER_SIZE, "features size");
#else
_Static_assert(sizeof(struct gpuos_kinfer_header) == GPUOS_KINFER_HEADER_SIZE, "header size");
_Static_assert(sizeof(struct gpuos_kinfer_meta) == 128, "meta size");
_Static_assert(sizeof(struct gpuos_kinfer_features) == GPUOS_KINFER_FEATURES_HEADER_SIZE, "features size");
#endif

#endif /* GPUOS_KINFER_H */
