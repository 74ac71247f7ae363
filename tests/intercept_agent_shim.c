/*
 * The direct route for tests/intercept_agent_prog.py: the addresses of driver functions as a
 * library linked against libcuda.so.1 binds them (through the dynamic linker, which puts a
 * preloaded interposer's definitions first).
 */
#include <string.h>

extern int cuStreamCreate(), cuModuleLoadData(), cuMemAlloc_v2(), cuMemcpyHtoD_v2(), cuLaunchKernel(),
    cuLaunchKernel_ptsz(), cuMemsetD32Async(), cuMemFree_v2(), cuModuleUnload(), cuStreamDestroy_v2(),
    cuModuleGetFunction();

void *shim_direct(const char *name) {
    static const struct { const char *name; void *fn; } fns[] = {
        {"cuStreamCreate", (void *)cuStreamCreate}, {"cuModuleLoadData", (void *)cuModuleLoadData},
        {"cuMemAlloc_v2", (void *)cuMemAlloc_v2}, {"cuMemcpyHtoD_v2", (void *)cuMemcpyHtoD_v2},
        {"cuLaunchKernel", (void *)cuLaunchKernel}, {"cuLaunchKernel_ptsz", (void *)cuLaunchKernel_ptsz},
        {"cuMemsetD32Async", (void *)cuMemsetD32Async}, {"cuMemFree_v2", (void *)cuMemFree_v2},
        {"cuModuleUnload", (void *)cuModuleUnload}, {"cuStreamDestroy_v2", (void *)cuStreamDestroy_v2},
        {"cuModuleGetFunction", (void *)cuModuleGetFunction},
    };
    for (unsigned i = 0; i < sizeof fns / sizeof fns[0]; i++)
        if (!strcmp(fns[i].name, name)) return fns[i].fn;
    return 0;
}
