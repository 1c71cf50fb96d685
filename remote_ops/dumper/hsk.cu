/* hsk.cu: one kernel launch for all of a copy job's copies (SGLANG_HS_DUMP_COPY=kernel).
 *
 * Why: a copy job of 8 gathered steps is 48 copies, and on the H200 VM each
 * driver copy call costs ~6 us of the thread that launches the model's
 * kernels (bench/README.md, cause 14).  One launch of this kernel on the side
 * stream does them all: its threads read the GPU tensors and store straight
 * into the writer's host buffer (page-locked and device-mapped), so the job is
 * fence + one launch + the completion post.  The price: the copies run on a
 * few SMs (`gridDim.x` blocks, fixed whatever the job's size) instead of the
 * copy engines.
 *
 * The same source is compiled twice: by NVRTC into hsk.ptx (scripts/build-hsk-ptx;
 * the PTX is checked in, the driver JIT-compiles it for the GPU at load) and by
 * the host C compiler with HSK_HOST defined, for the CPU tests, which run the
 * grid one block and thread at a time (tests/test_dump_kernel.py).
 *
 * A copy is hsq.c's: src, src pitch, dst, dst pitch, width bytes, height rows
 * (0: one contiguous row).  Every block walks every copy; within a copy all
 * the grid's threads stride over its elements, the widest of 16, 8, 4 or 1
 * bytes that divides both addresses, the width and (for rows) both pitches.
 */

#define HSK_MAX_COPIES 48

typedef unsigned long long u64;

struct hsk_copy {
    u64 src, src_pitch, dst, dst_pitch, width, height;
};

struct hsk_table {
    u64 count;
    struct hsk_copy copies[HSK_MAX_COPIES];
};

#ifdef HSK_HOST
/* The CPU build: the grid is a loop (hsk_run_grid), the vector types are plain structs. */
#include <stdint.h>
typedef struct { uint32_t x, y, z, w; } hsk_v16;
#define HSK_DEVICE static
#define HSK_GLOBAL
struct hsk_dim { unsigned x; };
static struct hsk_dim blockIdx, threadIdx, blockDim, gridDim;
#else
typedef uint4 hsk_v16;
#define HSK_DEVICE __device__ static
#define HSK_GLOBAL extern "C" __global__
#endif

/* Each thread loads HSK_UNROLL elements before it stores them: that many loads in flight per thread,
 * so a few blocks keep GPU memory busy when the destination is GPU memory too (the staged copy), where
 * one load at a time left each thread waiting ~0.7 us per 16 bytes. */
#define HSK_UNROLL 4

#define HSK_BODY(T)                                                                      \
    do {                                                                                 \
        u64 per_row = c->width / sizeof(T);                                              \
        u64 total = per_row * rows;                                                      \
        u64 i = first;                                                                   \
        for (; i + (HSK_UNROLL - 1) * stride < total; i += HSK_UNROLL * stride) {        \
            T v[HSK_UNROLL];                                                             \
            u64 r[HSK_UNROLL];                                                           \
            for (int j = 0; j < HSK_UNROLL; j++) {                                       \
                u64 e = i + j * stride;                                                  \
                r[j] = e / per_row;                                                      \
                v[j] = *((const T *)(c->src + r[j] * c->src_pitch) + (e - r[j] * per_row)); \
            }                                                                            \
            for (int j = 0; j < HSK_UNROLL; j++) {                                       \
                u64 e = i + j * stride;                                                  \
                *((T *)(c->dst + r[j] * c->dst_pitch) + (e - r[j] * per_row)) = v[j];    \
            }                                                                            \
        }                                                                                \
        for (; i < total; i += stride) {                                                 \
            u64 q = i / per_row, k = i - q * per_row;                                    \
            *((T *)(c->dst + q * c->dst_pitch) + k) = *((const T *)(c->src + q * c->src_pitch) + k); \
        }                                                                                \
    } while (0)

HSK_DEVICE void hsk_one(const struct hsk_copy *c, u64 first, u64 stride)
{
    u64 rows = c->height ? c->height : 1;
    u64 bits = c->src | c->dst | c->width | (rows > 1 ? (c->src_pitch | c->dst_pitch) : 0);
    if (!c->width)
        return;
    if (!(bits & 15))
        HSK_BODY(hsk_v16);
    else if (!(bits & 7))
        HSK_BODY(u64);
    else if (!(bits & 3))
        HSK_BODY(unsigned int);
    else
        HSK_BODY(unsigned char);
}

HSK_GLOBAL void hsk_copy_all(struct hsk_table t)
{
    u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 n = t.count < HSK_MAX_COPIES ? t.count : HSK_MAX_COPIES;
    for (u64 j = 0; j < n; j++)
        hsk_one(&t.copies[j], first, stride);
}

#ifdef HSK_HOST
/* The whole grid, one (block, thread) at a time: what the GPU's threads would store, in some order. */
int hsk_run_grid(const struct hsk_table *t, unsigned blocks, unsigned threads)
{
    gridDim.x = blocks;
    blockDim.x = threads;
    for (blockIdx.x = 0; blockIdx.x < blocks; blockIdx.x++)
        for (threadIdx.x = 0; threadIdx.x < threads; threadIdx.x++)
            hsk_copy_all(*t);
    return 0;
}
#endif
