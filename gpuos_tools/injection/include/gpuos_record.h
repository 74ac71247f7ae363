/*
 * The recorder shared by the two front ends that see the program's driver calls: the CUPTI
 * callback (gpuos_trace.c) and the interposer (gpuos_intercept.c built with -DGPUOS_AGENT). It
 * writes the binary records gpu-trace decodes (gpuos_tools/model/binary.py) into a buffer that a
 * thread of its own ships over the trace pipe, learns parameter layouts and kernel names from the
 * driver, and, built with -DGPUOS_AGENT, hands every operation to the native core (gpuos_core.h).
 */
#ifndef GPUOS_RECORD_H
#define GPUOS_RECORD_H

#include <stdint.h>

enum { REC_ENTER = 0, REC_EXIT = 1 };

/* A driver function by name (the front end knows how to reach the real driver), or NULL. */
typedef void *(*rec_lookup_fn)(const char *name);
void rec_resolve(rec_lookup_fn lookup);

/* Where records go and which calls are recorded: kinds holds n pairs (cbid, kind | 0x80 for a
   per-thread-stream variant). Call before rec_start. */
void rec_configure(int fd, const uint32_t *kinds, int n, int flush_ms, int check_pointers);
/* The writer thread; on_gone is called once when the pipe's reader went away. 0 or -1. */
int rec_start(void (*on_gone)(void));
int rec_running(void);
/* Stop the writer, ship what is left. counters: calls seen, errors, functions, nanoseconds spent
   recording on the program's path. */
void rec_finish(uint64_t counters[4]);

/* One driver call, at its enter and at its exit. params: the call's arguments in the layout of
   CUPTI's parameter structs (generated_cuda_meta.h); result: the CUresult (exit); ctx: the
   context, 0 when the front end does not know it (asked of the driver for allocations); sym: the
   kernel's name when the front end has it (else the driver is asked, once per function). */
void rec_call(uint32_t cbid, int site, const void *params, uint32_t result, uint64_t ctx, const char *sym);
uint8_t rec_kind(uint32_t cbid);

/* What CUPTI's resource callbacks say. */
void rec_module_loaded(uint64_t module_id, const void *image, uint64_t size);
void rec_module_unloading(void);
void rec_stream(uint64_t stream, int destroyed);
/* The size of a module image handed to a load call (cubin, fatbin or its wrapper, PTX text);
   0 when it is none of these. *image is moved to the fatbin a wrapper points to. */
uint64_t rec_image_size(const unsigned char **image);

void gpuos_trace_error(const char *msg);

#endif
