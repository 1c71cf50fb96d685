/* hsq.c: the dumper's native copy queue (built and loaded by native.py; stdlib C, libcuda by dlopen).
 *
 * Why: a captured batch needs 9 CUDA driver calls (fence record + wait, 6 copies, the completion
 * host function).  Made through ctypes from the thread that launches the model's kernels, they cost
 * ~85-100 us of that thread's CPU per batch (bench/README.md, issue 15), 0.5-0.7 % of a 15-20 ms
 * launch-bound step on their own.  Here the forward thread makes one call, hsq_submit: it records
 * the fence event on the forward stream (the point the copies must wait for) and puts the job in a
 * ring; a native thread (no Python, no GIL) makes the other 8 calls on the side stream.  With
 * threaded = 0 hsq_submit makes all 9 itself (one foreign call instead of nine).  A job may hold
 * the copies of several gathered steps (gather.py: up to 8 steps x 6 copies, one fence, one post).
 *
 * Order and lifetime: one thread issues every job, in submission order, on one side stream, so the
 * completion posts come in job order as before.  The caller keeps the source tensors referenced until
 * the writer process has seen the post (unchanged), and must call hsq_drain before it queues anything
 * else on the side stream.  Event i of the pool is recorded again only after the thread issued its
 * wait (a stream wait takes the event's state when it is issued).
 *
 * Failure: a job whose wait, copy or host function the driver refuses is cancelled: the thread
 * waits for the side stream (nothing of it lands later), writes cancel_value at cancel_addr (the
 * ring entry's state), posts the semaphore itself (the child moves past it) and records the job's
 * seq, which the caller collects with hsq_take_failed to free the job's buffer.
 *
 * hsq_set_wait, hsq_set_delay_us and hsq_set_pacing are for measuring (bench/dumper_paired.py's
 * native-* variants), not set by the dumper. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hsq_cuda.h"

#define HSQ_MAX_COPIES 48 /* 8 gathered steps of 6 copies (native.MAX_COPIES) */
#define HSQ_FAILED_KEPT 256

/* One copy: `height` rows of `width` bytes, device rows `src_pitch` apart into host rows `dst_pitch`
 * apart; height 0: one contiguous copy of `width` bytes. */
typedef struct {
    uint64_t src, src_pitch, dst, dst_pitch, width, height;
} hsq_copy;

typedef struct { /* native.JOB_HEAD + native.COPY, byte for byte */
    uint64_t seq;          /* the dumper's job seq (reported back on failure) */
    uint64_t stream;       /* the stream the sources were made on: the fence is recorded there */
    uint64_t post_addr;    /* sem_t * posted after the copies (0: none) */
    uint64_t cancel_addr;  /* int64_t * set to cancel_value when the job fails (0: none) */
    int64_t cancel_value;
    uint32_t ncopies, pad;
    hsq_copy copies[HSQ_MAX_COPIES];
} hsq_job;

typedef struct { /* read by Python without a call (native.STATE) */
    uint64_t failed;      /* jobs failed so far */
    uint64_t submitted;   /* jobs taken by hsq_submit */
    uint64_t issued;      /* jobs whose calls the thread made */
    int32_t first_error;  /* the first refused call's CUresult */
    int32_t error_call;   /* which call: 1 record, 2 wait, 3 copy, 4 host function, 5 context */
} hsq_state;

typedef struct {
    CUresult (*ctx_get)(CUcontext *);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_destroy)(CUevent);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*stream_wait)(CUstream, CUevent, unsigned);
    CUresult (*stream_sync)(CUstream);
    CUresult (*event_sync)(CUevent);
    CUresult (*d2h)(void *, uint64_t, size_t, CUstream);
    CUresult (*copy2d)(const CUDA_MEMCPY2D *, CUstream);
    CUresult (*host_fn)(CUstream, void (*)(void *), void *);
    void *lib;
    CUcontext ctx;
    CUstream side;
    int threaded;
    unsigned cap;
    CUevent *events;
    hsq_job *ring;
    pthread_mutex_t mu;
    pthread_cond_t work, room;
    int stop, thread_started;
    pthread_t thread;
    unsigned delay_us; /* hsq_set_delay_us: diagnosis only (bench/dumper_paired.py's native-late) */
    int spin;          /* hsq_set_wait(q, 1): diagnosis only: poll for work instead of sleeping */
    int batch, batch_applied; /* hsq_set_wait(q, 2): diagnosis only: the thread runs SCHED_BATCH */
    uint64_t slice_bytes;     /* hsq_set_pacing: experiment: copies in slices, each waited for ... */
    unsigned gap_us;          /* ... then this long without DMA */
    int thread_post;          /* ... and the post made by the thread, not a host function */
    int pacing_asked;         /* hsq_set_pacing was called: the thread makes pace_event */
    CUevent pace_event;       /* blocking-sync event the thread waits on (made by the thread) */
    hsq_state state;
    uint64_t failed_seq[HSQ_FAILED_KEPT];
    uint64_t failed_taken;
} hsq;

static void post(void *sem) { sem_post((sem_t *)sem); }

static void note_error(hsq *q, CUresult rc, int call) {
    if (!q->state.first_error) {
        q->state.error_call = call;
        __atomic_store_n(&q->state.first_error, rc, __ATOMIC_RELEASE);
    }
}

/* One piece of a copy: rows [r0, r0 + n) of a 2D copy, or bytes [r0, r0 + n) of a contiguous one. */
static CUresult copy_piece(hsq *q, const hsq_copy *c, uint64_t r0, uint64_t n) {
    if (!c->height) return q->d2h((void *)(uintptr_t)(c->dst + r0), c->src + r0, n, q->side);
    CUDA_MEMCPY2D p;
    memset(&p, 0, sizeof p);
    p.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    p.srcDevice = c->src + r0 * c->src_pitch;
    p.srcPitch = c->src_pitch;
    p.dstMemoryType = CU_MEMORYTYPE_HOST;
    p.dstHost = (void *)(uintptr_t)(c->dst + r0 * c->dst_pitch);
    p.dstPitch = c->dst_pitch;
    p.WidthInBytes = c->width;
    p.Height = n;
    return q->copy2d(&p, q->side);
}

/* The thread waits (asleep) until what it queued on the side stream ran. */
static CUresult wait_side(hsq *q) {
    CUresult rc = q->event_record(q->pace_event, q->side);
    return rc ? rc : q->event_sync(q->pace_event);
}

/* The job's copies; paced (thread, hsq_set_pacing): in slices of about slice_bytes, each waited for
 * and followed by gap_us without DMA. */
static CUresult issue_copies(hsq *q, const hsq_job *job, int paced) {
    uint64_t queued = 0;
    for (uint32_t i = 0; i < job->ncopies; i++) {
        const hsq_copy *c = &job->copies[i];
        uint64_t total = c->height ? c->height : c->width, unit = c->height ? c->width : 1, step = total;
        if (paced && unit) step = q->slice_bytes / unit ? q->slice_bytes / unit : 1;
        for (uint64_t r0 = 0, n; r0 < total; r0 += n) {
            n = total - r0 < step ? total - r0 : step;
            CUresult rc = copy_piece(q, c, r0, n);
            if (rc) return rc;
            queued += n * unit;
            if (paced && queued >= q->slice_bytes) {
                if ((rc = wait_side(q))) return rc;
                if (q->gap_us) usleep(q->gap_us);
                queued = 0;
            }
        }
    }
    return 0;
}

/* The wait (and, inline, the record), the copies, the post: 0, or the refused call's CUresult.
 * The post is a host function behind the copies, or (thread, hsq_set_pacing's thread_post) made by
 * the thread itself once it saw them land. */
static CUresult issue(hsq *q, const hsq_job *job, CUevent ev, int record, int *call) {
    CUresult rc;
    int own = !record && q->pace_event;  /* the thread waits for the side stream itself */
    *call = 1;
    if (record && (rc = q->event_record(ev, (CUstream)job->stream))) return rc;
    *call = 2;
    if ((rc = q->stream_wait(q->side, ev, 0))) return rc;
    *call = 3;
    if ((rc = issue_copies(q, job, own && q->slice_bytes))) return rc;
    *call = 4;
    if (!job->post_addr) return 0;
    if (!(own && q->thread_post)) return q->host_fn(q->side, post, (void *)(uintptr_t)job->post_addr);
    if ((rc = wait_side(q))) return rc;
    sem_post((sem_t *)(uintptr_t)job->post_addr);
    return 0;
}

/* A refused job (thread mode): let what was queued finish, cancel its entry, post for it, report it. */
static void fail(hsq *q, const hsq_job *job, CUresult rc, int call) {
    note_error(q, rc, call);
    q->stream_sync(q->side); /* its earlier copies may still run: none may land after the slot is freed */
    if (job->cancel_addr) __atomic_store_n((int64_t *)(uintptr_t)job->cancel_addr, job->cancel_value, __ATOMIC_RELEASE);
    if (job->post_addr) sem_post((sem_t *)(uintptr_t)job->post_addr);
    pthread_mutex_lock(&q->mu);
    q->failed_seq[q->state.failed % HSQ_FAILED_KEPT] = job->seq;
    __atomic_store_n(&q->state.failed, q->state.failed + 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&q->mu);
}

static void *run(void *arg) {
    hsq *q = arg;
    CUresult ctx_rc = q->ctx_set(q->ctx);
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (q->spin && q->state.issued == q->state.submitted && !q->stop) {
            pthread_mutex_unlock(&q->mu);
            while (__atomic_load_n(&q->state.submitted, __ATOMIC_ACQUIRE) == q->state.issued && q->spin && !q->stop)
                __builtin_ia32_pause();
            pthread_mutex_lock(&q->mu);
        }
        while (q->state.issued == q->state.submitted && !q->stop) pthread_cond_wait(&q->work, &q->mu);
        if (q->state.issued == q->state.submitted) break; /* stopped and drained */
        uint64_t n = q->state.issued;
        int pacing = q->pacing_asked, batch = q->batch;
        pthread_mutex_unlock(&q->mu);
        if (pacing && !q->pace_event &&
            q->event_create(&q->pace_event, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING))
            q->pace_event = NULL; /* stays unpaced */
        if (batch != q->batch_applied) {
            struct sched_param none = {0};
            sched_setscheduler(0, batch ? SCHED_BATCH : SCHED_OTHER, &none);
            q->batch_applied = batch;
        }
        const hsq_job *job = &q->ring[n % q->cap];
        int call = 5;
        if (q->delay_us) usleep(q->delay_us);
        CUresult rc = ctx_rc ? ctx_rc : issue(q, job, q->events[n % q->cap], 0, &call);
        if (rc) fail(q, job, rc, call);
        pthread_mutex_lock(&q->mu);
        q->state.issued = n + 1;
        pthread_cond_broadcast(&q->room);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

#define SYM(field, name)                                      \
    do {                                                      \
        *(void **)(&q->field) = dlsym(q->lib, name);          \
        if (!q->field) return -1;                             \
    } while (0)

static int bind(hsq *q, const char *libcuda) {
    q->lib = dlopen(libcuda, RTLD_NOW | RTLD_LOCAL);
    if (!q->lib) return -1;
    SYM(ctx_get, "cuCtxGetCurrent");
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(event_create, "cuEventCreate");
    SYM(event_destroy, "cuEventDestroy_v2");
    SYM(event_record, "cuEventRecord");
    SYM(stream_wait, "cuStreamWaitEvent");
    SYM(stream_sync, "cuStreamSynchronize");
    SYM(event_sync, "cuEventSynchronize");
    SYM(d2h, "cuMemcpyDtoHAsync_v2");
    SYM(copy2d, "cuMemcpy2DAsync_v2");
    SYM(host_fn, "cuLaunchHostFunc");
    return 0;
}

static void destroy(hsq *q) {
    if (q->pace_event) q->event_destroy(q->pace_event);
    if (q->events)
        for (unsigned i = 0; i < q->cap; i++)
            if (q->events[i]) q->event_destroy(q->events[i]);
    free(q->events);
    free(q->ring);
    if (q->lib) dlclose(q->lib);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->room);
    free(q);
}

/* A queue for copies on `side`, in the calling thread's current context; `cap` events and ring entries
 * (threaded) or one event (inline).  NULL when libcuda, its calls or the context are missing. */
hsq *hsq_open(const char *libcuda, uint64_t side, int threaded, unsigned cap) {
    hsq *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->room, NULL);
    q->side = (CUstream)(uintptr_t)side;
    q->threaded = threaded;
    q->cap = threaded ? (cap ? cap : 64) : 1;
    if (bind(q, libcuda) || q->ctx_get(&q->ctx) || !q->ctx) goto bad;
    q->events = calloc(q->cap, sizeof *q->events);
    q->ring = calloc(q->cap, sizeof *q->ring);
    if (!q->events || !q->ring) goto bad;
    for (unsigned i = 0; i < q->cap; i++)
        if (q->event_create(&q->events[i], CU_EVENT_DISABLE_TIMING)) goto bad;
    if (threaded) {
        if (pthread_create(&q->thread, NULL, run, q)) goto bad;
        q->thread_started = 1;
    }
    return q;
bad:
    destroy(q);
    return NULL;
}

const hsq_state *hsq_state_of(hsq *q) { return &q->state; }

/* Diagnosis only: the thread sleeps `us` before it issues each job (is the cost of its calls contention
 * with the forward thread's own driver calls right after the capture?). */
void hsq_set_delay_us(hsq *q, unsigned us) { q->delay_us = us; }

/* Experiment (thread mode; bench/dumper_paired.py's native-paced / native-threadpost): from the next
 * job on, copies in slices of about `slice_bytes` (0: whole), each waited for and followed by `gap_us`
 * without DMA, so that the next step's launches do not run beside all of a batch's D2H traffic; and
 * with `thread_post` the thread posts once it saw the copies land, instead of a host function. */
void hsq_set_pacing(hsq *q, uint64_t slice_bytes, unsigned gap_us, int thread_post) {
    pthread_mutex_lock(&q->mu);
    q->slice_bytes = slice_bytes;
    q->gap_us = gap_us;
    q->thread_post = thread_post;
    q->pacing_asked = 1;
    pthread_mutex_unlock(&q->mu);
}

/* Diagnosis only: how the thread waits for work: 0 sleeps (the default), 1 polls (never woken),
 * 2 sleeps under SCHED_BATCH (never preempts on wake-up).  Takes effect from its next job. */
void hsq_set_wait(hsq *q, int how) {
    pthread_mutex_lock(&q->mu);
    q->spin = how == 1;
    q->batch = how == 2;
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mu);
}

static int wait_until(hsq *q, pthread_cond_t *cond, int (*done)(hsq *), int timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    while (!done(q))
        if (pthread_cond_timedwait(cond, &q->mu, &until) == ETIMEDOUT) return done(q) ? 0 : -2;
    return 0;
}

static int has_room(hsq *q) { return q->stop || q->state.submitted - q->state.issued < q->cap; }
static int drained(hsq *q) { return q->state.issued == q->state.submitted; }

/* Queue `job` behind the work queued so far on job->stream.  0: queued; > 0: the fence's CUresult
 * (nothing queued); -1: closed; -2: no room within timeout_ms; -3: too many copies.  Inline: every
 * call made here, and a refused copy or post returns its CUresult (the caller synchronizes). */
int hsq_submit(hsq *q, const hsq_job *job, int timeout_ms) {
    int call;
    if (job->ncopies > HSQ_MAX_COPIES) return -3;
    if (!q->threaded) return issue(q, job, q->events[0], 1, &call);
    pthread_mutex_lock(&q->mu);
    int rc = q->stop ? -1 : wait_until(q, &q->room, has_room, timeout_ms);
    uint64_t n = q->state.submitted;
    pthread_mutex_unlock(&q->mu);
    if (rc) return q->stop ? -1 : rc;
    unsigned i = (unsigned)(n % q->cap);
    CUresult cu = q->event_record(q->events[i], (CUstream)job->stream);
    if (cu) {
        note_error(q, cu, 1);
        return cu;
    }
    memcpy(&q->ring[i], job, sizeof *job);
    pthread_mutex_lock(&q->mu);
    q->state.submitted = n + 1;
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

/* Wait until the thread has made the calls of every submitted job (not until the copies ran). */
int hsq_drain(hsq *q, int timeout_ms) {
    if (!q->threaded) return 0;
    pthread_mutex_lock(&q->mu);
    int rc = wait_until(q, &q->room, drained, timeout_ms);
    pthread_mutex_unlock(&q->mu);
    return rc;
}

/* Up to `max` seqs of failed jobs not taken before; how many. */
unsigned hsq_take_failed(hsq *q, uint64_t *out, unsigned max) {
    unsigned n = 0;
    pthread_mutex_lock(&q->mu);
    if (q->state.failed - q->failed_taken > HSQ_FAILED_KEPT) q->failed_taken = q->state.failed - HSQ_FAILED_KEPT;
    while (n < max && q->failed_taken < q->state.failed) out[n++] = q->failed_seq[q->failed_taken++ % HSQ_FAILED_KEPT];
    pthread_mutex_unlock(&q->mu);
    return n;
}

/* Stop after the submitted jobs are issued, join the thread, free everything.  0; -2: the thread did not
 * end within timeout_ms (the queue is then left allocated: it may still run). */
int hsq_close(hsq *q, int timeout_ms) {
    if (q->thread_started) {
        pthread_mutex_lock(&q->mu);
        q->stop = 1;
        pthread_cond_broadcast(&q->work);
        pthread_cond_broadcast(&q->room);
        pthread_mutex_unlock(&q->mu);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += timeout_ms / 1000 + 1;
        if (pthread_timedjoin_np(q->thread, NULL, &until)) return -2;
    }
    destroy(q);
    return 0;
}
