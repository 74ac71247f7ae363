/* A producer for gpu-kinfer-bridge written against gpuos_kinfer.h only (no Python).
 *
 *   cc -O2 -I gpuos_tools/kinfer/include examples/kinfer_producer.c -o kinfer_producer
 *   ./kinfer_producer RING N [ENTRY_VERSION]
 *
 * Sends N requests of 31 inputs (request k: input j = (k + j) % 10) one after the other and
 * prints one line per answer: "k status decision where batch out0 out1 rt_ns", rt_ns being the
 * round trip from before the request was written to after the answer was seen. ENTRY_VERSION (default
 * GPUOS_KINFER_ENTRY_VERSION) lets a test send entries of a wrong version. Exit status: 0 when
 * every request got an answer, 2 on bad use, 3 when the ring is unusable, 4 on a timeout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gpuos_kinfer.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *timeout)
{
    return syscall(SYS_futex, addr, op, val, timeout, NULL, 0);
}

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

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s RING N [ENTRY_VERSION]\n", argv[0]);
        return 2;
    }
    char path[512];
    snprintf(path, sizeof path, strchr(argv[1], '/') ? "%s" : "/dev/shm/%s", argv[1]);
    long n = atol(argv[2]);
    uint32_t entry_version = argc > 3 ? (uint32_t)atol(argv[3]) : GPUOS_KINFER_ENTRY_VERSION;

    int fd = open(path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return 3;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size < sizeof(struct gpuos_kinfer_header)) {
        fprintf(stderr, "%s: not a ring (a regular file of at least a header)\n", path);
        return 3;
    }
    /* a ring another user made could answer anything: trust this user's and root's (a ring shared
     * on purpose by another user: compare with that user's uid instead) */
    if (st.st_uid != geteuid() && st.st_uid != 0) {
        fprintf(stderr, "%s: belongs to uid %u, not to this user or root\n", path, (unsigned)st.st_uid);
        return 3;
    }
    uint8_t *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        fprintf(stderr, "%s: mmap: %s\n", path, strerror(errno));
        return 3;
    }
    struct gpuos_kinfer_header *h = (struct gpuos_kinfer_header *)base;
    if (h->magic != GPUOS_KINFER_MAGIC || h->version != GPUOS_KINFER_VERSION ||
        h->header_size != GPUOS_KINFER_HEADER_SIZE || h->meta_size != sizeof(struct gpuos_kinfer_meta) ||
        h->total_size > (uint64_t)st.st_size || h->max_inputs < 31) {
        fprintf(stderr, "%s: not a version %u ring of this layout\n", path, GPUOS_KINFER_VERSION);
        return 3;
    }
    uint32_t *state = (uint32_t *)(base + h->state_offset);
    struct gpuos_kinfer_meta *meta = (struct gpuos_kinfer_meta *)(base + h->meta_offset);
    float *inputs = (float *)(base + h->inputs_offset);
    float *outputs = (float *)(base + h->outputs_offset);

    uint32_t lane = 0;
    while (lane < h->lanes && lock_byte(fd, GPUOS_KINFER_LOCK_LANE0 + lane) < 0)
        lane++;
    if (lane == h->lanes) {
        fprintf(stderr, "%s: no free lane\n", path);
        return 3;
    }
    uint32_t slot = lane * h->slots_per_lane;
    if (__atomic_load_n(&state[slot], __ATOMIC_ACQUIRE) == GPUOS_KINFER_WRITING)
        __atomic_store_n(&state[slot], GPUOS_KINFER_FREE, __ATOMIC_RELEASE); /* left by a dead owner */

    for (long k = 0; k < n; k++) {
        uint32_t s = __atomic_load_n(&state[slot], __ATOMIC_ACQUIRE);
        if (s != GPUOS_KINFER_FREE && s != GPUOS_KINFER_DONE) {
            fprintf(stderr, "slot %u busy (state %u)\n", slot, s);
            return 4;
        }
        uint64_t t0 = now_ns();
        __atomic_store_n(&state[slot], GPUOS_KINFER_WRITING, __ATOMIC_RELAXED);
        struct gpuos_kinfer_meta *m = &meta[slot];
        m->version = entry_version;
        m->model_id = 0;
        m->n_inputs = 31;
        m->status = 0;
        m->seq = (uint64_t)k;
        m->submit_ns = t0;
        m->producer_pid = (uint32_t)getpid();
        m->waiting = 0;
        float *x = inputs + (size_t)slot * h->max_inputs;
        for (int j = 0; j < 31; j++)
            x[j] = (float)((k + j) % 10);
        __atomic_store_n(&state[slot], GPUOS_KINFER_READY, __ATOMIC_RELEASE);
        __atomic_fetch_add(&h->doorbell, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&h->daemon_sleeping, __ATOMIC_SEQ_CST))
            futex(&h->doorbell, FUTEX_WAKE, 1, NULL);

        uint64_t deadline = now_ns() + 5000000000ull;
        int spins = 0;
        for (;;) {
            s = __atomic_load_n(&state[slot], __ATOMIC_ACQUIRE);
            if (s == GPUOS_KINFER_DONE)
                break;
            if (now_ns() > deadline) {
                fprintf(stderr, "request %ld: no answer in 5 s (state %u)\n", k, s);
                return 4;
            }
            if (++spins < 20000)
                continue;
            __atomic_store_n(&m->waiting, 1, __ATOMIC_SEQ_CST);
            s = __atomic_load_n(&state[slot], __ATOMIC_SEQ_CST);
            if (s != GPUOS_KINFER_DONE) {
                struct timespec slice = {0, 2000000};
                futex(&state[slot], FUTEX_WAIT, s, &slice);
            }
        }
        uint64_t rt = now_ns() - t0;
        m->waiting = 0;
        float *y = outputs + (size_t)slot * h->max_outputs;
        printf("%ld %u %d %u %u %.6f %.6f %llu\n", k, m->status, m->decision, m->where, m->batch,
               m->n_outputs > 0 ? y[0] : 0.0f, m->n_outputs > 1 ? y[1] : 0.0f, (unsigned long long)rt);
        if (m->answer_seq != m->seq && m->status == GPUOS_KINFER_OK) {
            fprintf(stderr, "request %ld: answer for seq %llu\n", k, (unsigned long long)m->answer_seq);
            return 4;
        }
    }
    return 0;
}
