/*
 * The size classes of the PyTorch caches in front of the owned allocator (csrc/gpuos_alloc.c)
 * and of the managed-memory baseline (csrc/gpuos_um.c), shared so that both round a request
 * alike and a comparison between them moves the same bytes.
 *
 * Up to 1 MiB (and half a granule) a power of two from 512 B; above, a quarter of the power of
 * two below the size, then the granule g: at most 25% over, and a freed block serves only its
 * own class, so the waste stays bounded by the rounding.
 */
#ifndef GPUOS_SIZECLASS_H
#define GPUOS_SIZECLASS_H

#include <stddef.h>

#define GPUOS_CLASS_MIN_SHIFT 9  /* 512 B, CuPy's allocation unit */
#define GPUOS_CLASS_SMALL_SHIFT 20 /* 1 MiB */

static inline size_t gpuos_size_class(size_t size, size_t g) {
    if (size <= ((size_t)1 << GPUOS_CLASS_SMALL_SHIFT) && size <= g / 2) {
        unsigned shift = GPUOS_CLASS_MIN_SHIFT;
        while (((size_t)1 << shift) < size) shift++;
        return (size_t)1 << shift;
    }
    size_t p = (size_t)1 << (63 - __builtin_clzll((unsigned long long)size));
    size_t step = p / 4;
    size_t r = (size + step - 1) / step * step;
    return (r + g - 1) / g * g;
}

#endif
