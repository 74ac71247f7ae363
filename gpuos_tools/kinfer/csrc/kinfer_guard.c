/* kinfer_guard.c: keep a process alive when a shared file it maps is cut short under it (built by
 * gpuos_tools/kinfer/guard.py with the system C compiler, loaded with ctypes).
 *
 * A ring is a named file in /dev/shm that other processes (other users, where the ring is shared
 * on purpose) may open for writing; any of them can ftruncate it, and the next access past the
 * new end raises SIGBUS in whoever maps it. Sealing (F_SEAL_SHRINK) would forbid that, but only
 * memfds take seals, and a memfd has no name another user's producer could open. Checking the
 * size before each access races with the truncation. So, as Wayland compositors do for their
 * clients' shm pools, a SIGBUS handler recognises a fault inside a registered mapping and repairs
 * it: it gives the file its length back (ftruncate is async-signal-safe; the lost pages read as
 * zeros, the header and the requests in flight in them are gone) and returns, so the faulting
 * access completes. Where that fails (the file system is full, or the file keeps being cut: more
 * than KG_MAX_REPAIRS faults), it maps anonymous zero pages over the whole region instead and
 * marks it lost: the process goes on, reading zeros, and the daemon stops serving that ring.
 *
 * A fault elsewhere goes to the handler that was there before (Python's faulthandler, or the
 * default action), so real bugs still end the process as they would have.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#define KG_MAX_REGIONS 256
#define KG_MAX_REPAIRS 1000

struct kg_region {
    uintptr_t base; /* 0: free slot; published last (release) */
    size_t len;
    int fd;         /* the guard's own duplicate of the file's descriptor; -1: never extend, go straight to zero pages */
    off_t size;     /* the length the file must have */
    uint64_t faults;
    int lost;
};

static struct kg_region regions[KG_MAX_REGIONS];
static struct sigaction previous;
static int installed;

static void on_sigbus(int sig, siginfo_t *info, void *ctx)
{
    uintptr_t addr = (uintptr_t)info->si_addr;
    for (int i = 0; i < KG_MAX_REGIONS; i++) {
        struct kg_region *r = &regions[i];
        uintptr_t base = __atomic_load_n(&r->base, __ATOMIC_ACQUIRE);
        if (base == 0 || addr < base || addr >= base + __atomic_load_n(&r->len, __ATOMIC_ACQUIRE))
            continue;
        uint64_t n = __atomic_add_fetch(&r->faults, 1, __ATOMIC_RELAXED);
        if (!__atomic_load_n(&r->lost, __ATOMIC_RELAXED) && r->fd >= 0 && n <= KG_MAX_REPAIRS && ftruncate(r->fd, r->size) == 0)
            return; /* the page is back inside the file: the access is retried and completes */
        if (mmap((void *)base, r->len, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED) {
            __atomic_store_n(&r->lost, 1, __ATOMIC_RELEASE);
            return;
        }
        break; /* cannot repair: die as we would have */
    }
    if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != NULL) {
        previous.sa_sigaction(sig, info, ctx);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN && !(previous.sa_flags & SA_SIGINFO)) {
        previous.sa_handler(sig);
        return;
    }
    /* the default action: put it back; the access faults again and ends the process */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &dfl, NULL);
}

/* Install the handler (again, if something replaced it since). Returns 0, or -1 with errno. */
int kg_install(void)
{
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return -1;
    if (installed && (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0)
        return -1;
    installed = 1;
    return 0;
}

/* Watch [base, base + len), a mapping of fd whose file must be size bytes long (fd is duplicated:
 * the caller may close its own). Returns the region's index, or -1 when every slot is taken or
 * the descriptor cannot be duplicated. */
int kg_protect(void *base, uint64_t len, int fd, int64_t size)
{
    int own = -1;
    if (fd >= 0 && (own = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0)
        return -1;
    for (int i = 0; i < KG_MAX_REGIONS; i++) {
        struct kg_region *r = &regions[i];
        uintptr_t expected = 0;
        /* claim the slot with a placeholder base (1; its len is 0, so no address matches), then
         * fill it in and publish the real base last */
        if (!__atomic_compare_exchange_n(&r->base, &expected, (uintptr_t)1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;
        r->fd = own;
        r->size = (off_t)size;
        __atomic_store_n(&r->faults, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&r->lost, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&r->len, (size_t)len, __ATOMIC_RELEASE);
        __atomic_store_n(&r->base, (uintptr_t)base, __ATOMIC_RELEASE);
        return i;
    }
    if (own >= 0)
        close(own);
    return -1;
}

/* Stop watching region i (before its mapping goes away) and close the guard's descriptor. */
void kg_release(int i)
{
    if (i < 0 || i >= KG_MAX_REGIONS)
        return;
    struct kg_region *r = &regions[i];
    if (__atomic_load_n(&r->base, __ATOMIC_ACQUIRE) <= 1)
        return; /* free, or being filled in */
    int fd = r->fd;
    __atomic_store_n(&r->len, (size_t)0, __ATOMIC_RELEASE);
    r->fd = -1;
    __atomic_store_n(&r->base, (uintptr_t)0, __ATOMIC_RELEASE);
    if (fd >= 0)
        close(fd);
}

/* Faults repaired in region i so far, and whether it was lost (zero pages mapped over it). */
uint64_t kg_faults(int i)
{
    return i >= 0 && i < KG_MAX_REGIONS ? __atomic_load_n(&regions[i].faults, __ATOMIC_RELAXED) : 0;
}

int kg_lost(int i)
{
    return i >= 0 && i < KG_MAX_REGIONS ? __atomic_load_n(&regions[i].lost, __ATOMIC_ACQUIRE) : 0;
}
