/* hsq_cuda.h: the few cuda.h types and values hsq.c uses (also those of tests/cuda_standin.c,
 * the CPU tests' stand-in for libcuda), so that the driver's headers are not needed to build. */
#ifndef HSQ_CUDA_H
#define HSQ_CUDA_H
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUcontext;

typedef struct { /* cuda.h's CUDA_MEMCPY2D (the _v2 layout) */
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    uint64_t srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    uint64_t dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;

#define CU_MEMORYTYPE_HOST 1
#define CU_MEMORYTYPE_DEVICE 2
#define CU_EVENT_BLOCKING_SYNC 1
#define CU_EVENT_DISABLE_TIMING 2

#endif
