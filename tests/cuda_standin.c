/* A stand-in for the libcuda entry points hsq.c calls, for CPU-only tests (no GPU here).
 * Copies are done at once with memmove on host memory ("device" pointers are host pointers), a host
 * function runs at once, events and waits do nothing.  Knobs for the tests: standin_fail_copy (fail the
 * copy call with that 1-based number with CUresult 700), standin_fail_record (fail event records),
 * standin_copies (copy calls so far), standin_copy_thread (the thread of the last copy call),
 * standin_host_fns and standin_event_syncs (host functions launched, event waits made). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hsq_cuda.h" /* remote_ops/dumper/: the cuda.h subset hsq.c uses */

long standin_fail_copy = 0;
int standin_fail_record = 0;
long standin_copies = 0;
long standin_syncs = 0;
unsigned long standin_copy_thread = 0;
static int ctx_token;

unsigned long standin_self(void) { return (unsigned long)pthread_self(); }

int cuCtxGetCurrent(void **ctx) { *ctx = &ctx_token; return 0; }
int cuCtxSetCurrent(void *ctx) { return ctx == &ctx_token ? 0 : 201; }
int cuEventCreate(void **ev, unsigned flags) { (void)flags; *ev = malloc(8); return *ev ? 0 : 2; }
int cuEventDestroy_v2(void *ev) { free(ev); return 0; }
int cuEventRecord(void *ev, void *stream) { (void)ev; (void)stream; return standin_fail_record ? 400 : 0; }
int cuStreamWaitEvent(void *stream, void *ev, unsigned flags) { (void)stream; (void)ev; (void)flags; return 0; }
long standin_host_fns = 0;
long standin_event_syncs = 0;
int cuEventSynchronize(void *ev) { (void)ev; __atomic_add_fetch(&standin_event_syncs, 1, __ATOMIC_SEQ_CST); return 0; }
int cuStreamSynchronize(void *stream) { (void)stream; __atomic_add_fetch(&standin_syncs, 1, __ATOMIC_SEQ_CST); return 0; }

static int counted_copy(void) {
    long n = __atomic_add_fetch(&standin_copies, 1, __ATOMIC_SEQ_CST);
    standin_copy_thread = (unsigned long)pthread_self();
    return n == standin_fail_copy ? 700 : 0;
}

int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t n, void *stream) {
    (void)stream;
    if (counted_copy()) return 700;
    memmove(dst, (const void *)(uintptr_t)src, n);
    return 0;
}

int cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, void *stream) {
    (void)stream;
    if (counted_copy()) return 700;
    if (p->srcMemoryType != CU_MEMORYTYPE_DEVICE || p->dstMemoryType != CU_MEMORYTYPE_HOST || p->srcPitch < p->WidthInBytes || p->dstPitch < p->WidthInBytes)
        return 1;
    for (size_t r = 0; r < p->Height; r++)
        memmove((char *)p->dstHost + r * p->dstPitch, (const char *)(uintptr_t)p->srcDevice + r * p->srcPitch,
                p->WidthInBytes);
    return 0;
}

int cuLaunchHostFunc(void *stream, void (*fn)(void *), void *data) {
    (void)stream;
    __atomic_add_fetch(&standin_host_fns, 1, __ATOMIC_SEQ_CST);
    fn(data);
    return 0;
}
