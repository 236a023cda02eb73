/* jit_pool.c - compile many rendered sources at once on worker threads (see
 * m3_jit_build_many in jit.h): the tuner's candidates, `m3kit gen --all`, the
 * runtime's warm-up.  Lua renders on the caller's thread; NVRTC programs are
 * independent, so workers need no lock but the queue's. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/jit.h"

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}



typedef struct {
  m3_jit *jit;
  m3_jit_job *jobs;
  int n, next, finished;
  pthread_mutex_t mu;
  pthread_cond_t cv;
} cpool;

static void *compile_worker(void *p) {
  cpool *cp = p;
  for (;;) {
    pthread_mutex_lock(&cp->mu);
    int i = cp->next < cp->n ? cp->next++ : -1;
    pthread_mutex_unlock(&cp->mu);
    if (i < 0) return NULL;
    m3_jit_job *j = &cp->jobs[i];
    if (j->rendered) {
      m3_cubin cb;
      m3_err e;
      j->status = m3_jit_build_rendered(cp->jit, &j->v, &j->src, &cb, &e);
      if (j->status) snprintf(j->reason, sizeof j->reason, "%.*s", (int)sizeof j->reason - 1, e.msg);
      j->hit = cb.hit;
      j->size = cb.size;
      m3_cubin_free(&cb);
    }
    pthread_mutex_lock(&cp->mu);
    j->done = 1;
    cp->finished++;
    pthread_cond_broadcast(&cp->cv);
    pthread_mutex_unlock(&cp->mu);
  }
}

/* Compile every job; jobs still running after the time-out are marked
 * COMPILE_TIMEOUT (their threads are left to finish on their own). */
void m3_jit_build_many(m3_jit *jit, m3_jit_job *jobs, int n, int threads, int timeout_s) {
  cpool cp = {.jit = jit, .jobs = jobs, .n = n};
  pthread_mutex_init(&cp.mu, NULL);
  pthread_cond_init(&cp.cv, NULL);
  if (threads < 1) threads = 1;
  pthread_t *th = calloc((size_t)threads, sizeof *th);
  for (int i = 0; i < threads; i++) pthread_create(&th[i], NULL, compile_worker, &cp);
  /* A generous whole-batch limit: each job's own limit times the rounds. */
  double limit = now_s() + (double)timeout_s * (1 + n / threads);
  pthread_mutex_lock(&cp.mu);
  while (cp.finished < n) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 1;
    pthread_cond_timedwait(&cp.cv, &cp.mu, &ts);
    if (now_s() > limit) break;
  }
  int all = cp.finished == n;
  for (int i = 0; i < n; i++)
    if (!jobs[i].done) {
      jobs[i].status = M3_TIMEOUT;
      snprintf(jobs[i].reason, sizeof jobs[i].reason, "NVRTC did not finish within the tuner's limit");
    }
  pthread_mutex_unlock(&cp.mu);
  for (int i = 0; i < threads; i++) {
    if (all) pthread_join(th[i], NULL);
    else pthread_detach(th[i]);
  }
  free(th);
}

