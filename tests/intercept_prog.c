/*
 * A program that reaches the driver (tests/fake_libcuda_entry.c, as libcuda.so.1) every way a
 * real one does: linked calls, dlsym on a dlopen'ed handle, cuGetProcAddress (v2 and v1, the
 * legacy and the per-thread-stream answer, an old signature, an answer that is not an exported
 * symbol, cuGetProcAddress handed out by itself), dlsym(RTLD_DEFAULT), and threads launching at
 * once. It checks that every launch reached the driver with its arguments intact, then prints
 * the driver's own counts as JSON (the ground truth for the interposer's).
 *
 *   intercept_prog all THREADS        the sequence below (tests/test_intercept.py knows its counts)
 *   intercept_prog bench N [ROUTE]    N launches through one route (direct|dlsym|getproc), then
 *                                     {"ns_per_call": ...}: the cost of a call, with or without
 *                                     the interposer preloaded
 *
 * Build: cc -O2 -o intercept_prog intercept_prog.c DIR/libcuda.so.1 -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        void *, void **, void **);
typedef int (*getproc_v1_t)(const char *, void **, int, uint64_t);
typedef int (*getproc_v2_t)(const char *, void **, int, uint64_t, int *);

/* the driver's exports this program links against */
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                   void **, void **);
int cuLaunchKernelEx(const void *, void *, void **, void **);
int cuMemAlloc_v2(uint64_t *, size_t);
int cuMemFree_v2(uint64_t);
int cuMemcpyHtoD_v2(uint64_t, const void *, size_t);
int cuMemAddressReserve(uint64_t *, size_t, size_t, uint64_t, unsigned long long);
int cuMemAddressFree(uint64_t, size_t);
int cuMemCreate(uint64_t *, size_t, const void *, unsigned long long);
int cuMemRelease(uint64_t);
int cuMemMap(uint64_t, size_t, size_t, uint64_t, unsigned long long);
int cuMemUnmap(uint64_t, size_t);
int fake_entry_counts(int64_t *, int);
void fake_last_launch(uint64_t *);

#define K(n) ((void *)(uintptr_t)(0x100000u + 0x10u * (n)))
#define G (2u << 20)

static void fail(const char *what) {
    fprintf(stderr, "intercept_prog: %s\n", what);
    exit(1);
}
static void ok(int rc, const char *what) {
    if (rc) fail(what);
}

static void *params[2] = {(void *)0x11, (void *)0x22};

/* launch f with arguments derived from seq, and check the driver received exactly those */
static void launch_checked(launch_t fn, void *f, unsigned seq, const char *what) {
    unsigned g = seq % 1000 + 1;
    void *stream = (void *)(uintptr_t)(0x5000 + seq);
    ok(fn(f, g, g + 1, g + 2, g + 3, g + 4, g + 5, 1024u * seq, stream, params, NULL), what);
    uint64_t got[11];
    fake_last_launch(got);
    uint64_t want[11] = {(uint64_t)(uintptr_t)f, g, g + 1, g + 2, g + 3, g + 4, g + 5, 1024u * seq,
                         (uint64_t)(uintptr_t)stream, (uint64_t)(uintptr_t)params, 0};
    if (memcmp(got, want, sizeof want)) fail("a launch reached the driver with other arguments");
}

static getproc_v2_t getproc;

static void *proc(const char *sym, int version, uint64_t flags) {
    void *fn = NULL;
    int status = -1;
    ok(getproc(sym, &fn, version, flags, &status), "cuGetProcAddress_v2");
    return fn;
}

static void *thread_main(void *arg) {
    unsigned t = (unsigned)(uintptr_t)arg;
    launch_t fn = (launch_t)proc("cuLaunchKernel", 12000, 0);
    if (!fn) fail("no cuLaunchKernel in a thread");
    for (int i = 0; i < 1000; i++) ok(fn(K(100 + t), 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), "thread launch");
    return NULL;
}

static void run_all(int threads) {
    /* direct: the linked exports */
    for (unsigned i = 0; i < 3; i++) launch_checked(cuLaunchKernel, K(1), i, "direct launch");
    char cfg[64] = {0};
    for (int i = 0; i < 2; i++) ok(cuLaunchKernelEx(cfg, K(2), params, NULL), "direct launch ex");
    uint64_t p = 0, va = 0, h = 0;
    char host[16] = "0123456789abcde";
    ok(cuMemAlloc_v2(&p, 4096), "cuMemAlloc_v2");
    ok(cuMemcpyHtoD_v2(p, host, sizeof host), "cuMemcpyHtoD_v2");
    ok(cuMemFree_v2(p), "cuMemFree_v2");
    ok(cuMemAddressReserve(&va, G, 0, 0, 0), "cuMemAddressReserve");
    ok(cuMemCreate(&h, G, NULL, 0), "cuMemCreate");
    ok(cuMemMap(va, G, 0, h, 0), "cuMemMap");
    ok(cuMemUnmap(va, G), "cuMemUnmap");
    ok(cuMemRelease(h), "cuMemRelease");
    ok(cuMemAddressFree(va, G), "cuMemAddressFree");

    /* dlsym on a handle of the driver */
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cuda) fail(dlerror());
    launch_t by_dlsym = (launch_t)dlsym(cuda, "cuLaunchKernel");
    if (!by_dlsym) fail("dlsym cuLaunchKernel");
    for (unsigned i = 0; i < 4; i++) launch_checked(by_dlsym, K(3), 10 + i, "dlsym launch");

    /* cuGetProcAddress, itself found with dlsym (as the CUDA runtime does) */
    getproc = (getproc_v2_t)dlsym(cuda, "cuGetProcAddress_v2");
    if (!getproc) fail("dlsym cuGetProcAddress_v2");
    launch_t legacy = (launch_t)proc("cuLaunchKernel", 12000, 0);
    launch_t ptsz = (launch_t)proc("cuLaunchKernel", 12000, 2);
    if (!legacy || !ptsz || legacy == ptsz) fail("cuGetProcAddress cuLaunchKernel");
    for (unsigned i = 0; i < 5; i++) launch_checked(legacy, K(4), 20 + i, "getproc launch");
    int64_t before[16], after[16];
    fake_entry_counts(before, 16);
    for (unsigned i = 0; i < 6; i++) launch_checked(ptsz, K(5), 30 + i, "getproc ptsz launch");
    fake_entry_counts(after, 16);
    if (after[1] - before[1] != 6 || after[0] != before[0]) fail("the per-thread-stream launch lost its variant");

    int (*alloc_v2)(uint64_t *, size_t) = (int (*)(uint64_t *, size_t))proc("cuMemAlloc", 12000, 0);
    int (*alloc_v1)(uint32_t *, unsigned) = (int (*)(uint32_t *, unsigned))proc("cuMemAlloc", 3000, 0);
    ok(alloc_v2(&p, 8192), "getproc cuMemAlloc_v2");
    uint32_t small = 0;
    ok(alloc_v1(&small, 64), "getproc cuMemAlloc (v1)");
    if (small != 0x1000u + 64) fail("the old cuMemAlloc got other arguments");
    int (*memset_async)(uint64_t, unsigned, size_t, void *) =
        (int (*)(uint64_t, unsigned, size_t, void *))proc("cuMemsetD32Async", 12000, 0);
    for (int i = 0; i < 2; i++) ok(memset_async(p, 7, 16, NULL), "getproc cuMemsetD32Async");

    getproc_v2_t gp2 = (getproc_v2_t)proc("cuGetProcAddress", 12000, 0);
    void *fn = NULL;
    int status = 0;
    ok(gp2("cuMemFree", &fn, 12000, 0, &status), "getproc'd cuGetProcAddress_v2");
    ok(((int (*)(uint64_t))fn)(p), "getproc'd cuMemFree_v2");
    getproc_v1_t gp1 = (getproc_v1_t)proc("cuGetProcAddress", 11030, 0);
    ok(gp1("cuLaunchKernel", &fn, 12000, 0), "getproc'd cuGetProcAddress (v1)");
    launch_checked((launch_t)fn, K(6), 40, "launch through cuGetProcAddress v1");
    if (!proc("cuFuncGetName", 12030, 0)) fail("cuFuncGetName");

    /* dlsym(RTLD_DEFAULT): what the global scope has first */
    launch_t by_default = (launch_t)dlsym(RTLD_DEFAULT, "cuLaunchKernel");
    if (!by_default) fail("dlsym RTLD_DEFAULT cuLaunchKernel");
    launch_checked(by_default, K(7), 50, "RTLD_DEFAULT launch");

    pthread_t tids[64];
    if (threads > 64) threads = 64;
    for (int t = 0; t < threads; t++)
        if (pthread_create(&tids[t], NULL, thread_main, (void *)(uintptr_t)t)) fail("pthread_create");
    for (int t = 0; t < threads; t++) pthread_join(tids[t], NULL);

    int64_t c[16];
    int n = fake_entry_counts(c, 16);
    static const char *const names[] = {"launch", "launch_ptsz", "launch_ex", "launch_coop", "graph_launch",
                                        "alloc_v1", "alloc_v2", "free_v2", "htod", "dtoh", "memset_d32_async",
                                        "getproc_v1", "getproc_v2", "func_name"};
    printf("{");
    for (int i = 0; i < n && i < 14; i++) printf("%s\"%s\": %lld", i ? ", " : "", names[i], (long long)c[i]);
    printf("}\n");
}

static double bench(long n, const char *route) {
    launch_t fn = cuLaunchKernel;
    if (strcmp(route, "direct")) {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!cuda) fail(dlerror());
        if (!strcmp(route, "dlsym")) {
            fn = (launch_t)dlsym(cuda, "cuLaunchKernel");
        } else {
            getproc = (getproc_v2_t)dlsym(cuda, "cuGetProcAddress_v2");
            fn = (launch_t)proc("cuLaunchKernel", 12000, 0);
        }
    }
    if (!fn) fail("no cuLaunchKernel");
    for (long i = 0; i < n / 10 + 1; i++) fn(K(1), 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL); /* warm */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) fn(K(1 + (i & 63)), 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return ((double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec)) / (double)n;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "all")) {
        run_all(argc >= 3 ? atoi(argv[2]) : 4);
        return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "bench")) {
        const char *route = argc >= 4 ? argv[3] : "getproc";
        printf("{\"route\": \"%s\", \"ns_per_call\": %.2f}\n", route, bench(atol(argv[2]), route));
        return 0;
    }
    fprintf(stderr, "usage: intercept_prog all [THREADS] | bench N [direct|dlsym|getproc]\n");
    return 2;
}
