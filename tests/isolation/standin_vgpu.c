/* A stand-in for HAMi-core's libvgpu.so in the isolation-check tests, written from HAMi-core's
 * documented behaviour (not from its code): preloaded with LD_PRELOAD, it overrides dlsym so that
 * looking up the driver's functions through a libcuda handle returns its hooks, and it
 *
 *   - holds each GPU to CUDA_DEVICE_MEMORY_LIMIT_<i> (or CUDA_DEVICE_MEMORY_LIMIT for all;
 *     "2048m", "2g", "512k" or bytes), counting what every process that names the same
 *     CUDA_DEVICE_MEMORY_SHARED_CACHE file uses (a flock'd file of per-pid records; dead pids are
 *     ignored), each process's context included (STANDIN_VGPU_CTX_MIB, default 64);
 *   - reports the limit through cuMemGetInfo_v2 (total = limit, free = limit - usage) and
 *     cuDeviceTotalMem_v2;
 *   - with CUDA_DEVICE_SM_LIMIT=P (1-99) and GPU_CORE_UTILIZATION_POLICY other than "disable",
 *     holds the process's kernels to P % of the GPU's time: a launch waits until the GPU time its
 *     kernels took is at most P % of the time since its first launch. Capped processes take turns
 *     on a GPU through a lock file in STANDIN_VGPU_LOCK_DIR (default /tmp/vgpulock), so the time
 *     a kernel waits for another process's kernel is not counted as its own (HAMi-core reads the
 *     per-process utilisation from NVML instead).
 *
 * To show the check failing:
 *   STANDIN_VGPU_SLACK_MIB=N   let allocations go N MiB past the limit
 *   STANDIN_VGPU_IGNORE_SM=1   ignore the compute cap
 *
 * The real driver is dlopen'ed ("libcuda.so.1", from the library path).
 * Build: gcc -shared -fPIC -o libvgpu.so standin_vgpu.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUfunction;
typedef void *CUstream;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define MAX_DEVICES 16
#define MAX_RECORDS 512
#define MIB (1024ULL * 1024ULL)

typedef struct { int32_t pid; int32_t dev; uint64_t bytes; } record;
typedef struct { CUdeviceptr ptr; size_t size; } allocation;

static void *(*real_dlsym)(void *, const char *);
static void *cuda;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static CUresult (*real_ctx_create)(CUcontext *, unsigned, CUdevice);
static CUresult (*real_ctx_destroy)(CUcontext);
static CUresult (*real_primary_retain)(CUcontext *, CUdevice);
static CUresult (*real_primary_release)(CUdevice);
static CUresult (*real_mem_get_info)(size_t *, size_t *);
static CUresult (*real_mem_alloc)(CUdeviceptr *, size_t);
static CUresult (*real_mem_free)(CUdeviceptr);
static CUresult (*real_total_mem)(size_t *, CUdevice);
static CUresult (*real_launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, CUstream, void **, void **);

static unsigned long long limit[MAX_DEVICES];
static unsigned long long slack, ctx_charge = 64 * MIB;
static char cache_path[1024];
static unsigned long long local_used[MAX_DEVICES]; /* without a shared cache */
static int sm_limit; /* 0: no cap */
static char lock_dir[512] = "/tmp/vgpulock";
static int cur_dev = -1;
static allocation *allocs;
static size_t alloc_count, alloc_cap;
static unsigned long long first_launch_ns, busy_ns;

static unsigned long long parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    switch (*end) {
    case 'k': case 'K': v *= 1024.0; break;
    case 'm': case 'M': v *= (double)MIB; break;
    case 'g': case 'G': v *= (double)MIB * 1024.0; break;
    default: break;
    }
    return (unsigned long long)v;
}

static void resolve_dlsym(void) {
    if (real_dlsym) return;
    real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

static void init(void) {
    resolve_dlsym();
    cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (cuda) {
        real_ctx_create = real_dlsym(cuda, "cuCtxCreate_v2");
        real_ctx_destroy = real_dlsym(cuda, "cuCtxDestroy_v2");
        real_primary_retain = real_dlsym(cuda, "cuDevicePrimaryCtxRetain");
        real_primary_release = real_dlsym(cuda, "cuDevicePrimaryCtxRelease_v2");
        real_mem_get_info = real_dlsym(cuda, "cuMemGetInfo_v2");
        real_mem_alloc = real_dlsym(cuda, "cuMemAlloc_v2");
        real_mem_free = real_dlsym(cuda, "cuMemFree_v2");
        real_total_mem = real_dlsym(cuda, "cuDeviceTotalMem_v2");
        real_launch = real_dlsym(cuda, "cuLaunchKernel");
    }
    const char *all = getenv("CUDA_DEVICE_MEMORY_LIMIT");
    for (int i = 0; i < MAX_DEVICES; i++) {
        char name[64];
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        const char *v = getenv(name);
        if (v && *v) limit[i] = parse_size(v);
        else if (all && *all) limit[i] = parse_size(all);
    }
    const char *s = getenv("STANDIN_VGPU_SLACK_MIB");
    if (s) slack = strtoull(s, NULL, 10) * MIB;
    const char *c = getenv("STANDIN_VGPU_CTX_MIB");
    if (c) ctx_charge = strtoull(c, NULL, 10) * MIB;
    const char *cache = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (cache) snprintf(cache_path, sizeof cache_path, "%s", cache);
    const char *policy = getenv("GPU_CORE_UTILIZATION_POLICY");
    const char *sm = getenv("CUDA_DEVICE_SM_LIMIT");
    const char *ignore = getenv("STANDIN_VGPU_IGNORE_SM");
    int p = sm ? atoi(sm) : 0;
    if (p > 0 && p < 100 && !(policy && !strcmp(policy, "disable")) && !(ignore && !strcmp(ignore, "1")))
        sm_limit = p;
    const char *ld = getenv("STANDIN_VGPU_LOCK_DIR");
    if (ld && *ld) snprintf(lock_dir, sizeof lock_dir, "%s", ld);
}

/* ---- usage shared through the cache file ---- */

static int alive(int32_t pid) {
    return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

typedef struct { int fd; record recs[MAX_RECORDS]; } cache_t;

/* Locks the cache; returns every other live process's usage on dev. */
static unsigned long long cache_lock(cache_t *c, int dev) {
    c->fd = cache_path[0] ? open(cache_path, O_RDWR | O_CREAT | O_CLOEXEC, 0666) : -1;
    memset(c->recs, 0, sizeof c->recs);
    if (c->fd < 0) return 0;
    flock(c->fd, LOCK_EX);
    ssize_t n = pread(c->fd, c->recs, sizeof c->recs, 0);
    (void)n;
    unsigned long long used = 0;
    for (int i = 0; i < MAX_RECORDS; i++) {
        if (!alive(c->recs[i].pid)) { c->recs[i].pid = 0; c->recs[i].bytes = 0; continue; }
        if (c->recs[i].pid == getpid()) continue;
        if (c->recs[i].dev == dev) used += c->recs[i].bytes;
    }
    return used;
}

static record *own_record(cache_t *c, int dev) {
    record *slot = NULL;
    for (int i = 0; i < MAX_RECORDS; i++) {
        if (c->recs[i].pid == getpid() && c->recs[i].dev == dev) return &c->recs[i];
        if (!slot && c->recs[i].pid == 0) slot = &c->recs[i];
    }
    if (slot) { slot->pid = getpid(); slot->dev = dev; slot->bytes = 0; }
    return slot;
}

static unsigned long long own_usage(cache_t *c, int dev) {
    if (c->fd < 0) return local_used[dev];
    for (int i = 0; i < MAX_RECORDS; i++)
        if (c->recs[i].pid == getpid() && c->recs[i].dev == dev) return c->recs[i].bytes;
    return 0;
}

static void cache_unlock(cache_t *c, int dev, long long delta) {
    if (c->fd < 0) {
        local_used[dev] = (long long)local_used[dev] + delta < 0 ? 0 : local_used[dev] + delta;
        return;
    }
    if (delta) {
        record *r = own_record(c, dev);
        if (r) r->bytes = (long long)r->bytes + delta < 0 ? 0 : r->bytes + delta;
    }
    ssize_t n = pwrite(c->fd, c->recs, sizeof c->recs, 0);
    (void)n;
    flock(c->fd, LOCK_UN);
    close(c->fd);
}

static int limited(void) {
    return cur_dev >= 0 && cur_dev < MAX_DEVICES && limit[cur_dev];
}

/* ---- hooks ---- */

static CUresult create_accounting(CUresult rc, CUdevice dev) {
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&mu);
    cur_dev = dev;
    if (limited()) {
        cache_t c;
        cache_lock(&c, cur_dev);
        cache_unlock(&c, cur_dev, (long long)ctx_charge);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult hook_ctx_create(CUcontext *ctx, unsigned flags, CUdevice dev) {
    return create_accounting(real_ctx_create(ctx, flags, dev), dev);
}

static CUresult hook_primary_retain(CUcontext *ctx, CUdevice dev) {
    return create_accounting(real_primary_retain(ctx, dev), dev);
}

static CUresult release_accounting(CUresult rc) {
    pthread_mutex_lock(&mu);
    if (rc == CUDA_SUCCESS && limited()) {
        cache_t c;
        cache_lock(&c, cur_dev);
        cache_unlock(&c, cur_dev, -(long long)own_usage(&c, cur_dev));
        alloc_count = 0;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult hook_primary_release(CUdevice dev) {
    return release_accounting(real_primary_release(dev));
}

static CUresult hook_ctx_destroy(CUcontext ctx) {
    return release_accounting(real_ctx_destroy(ctx));
}

static CUresult hook_mem_get_info(size_t *free_bytes, size_t *total_bytes) {
    CUresult rc = real_mem_get_info(free_bytes, total_bytes);
    if (rc != CUDA_SUCCESS || !limited()) return rc;
    pthread_mutex_lock(&mu);
    cache_t c;
    unsigned long long used = cache_lock(&c, cur_dev);
    used += own_usage(&c, cur_dev);
    cache_unlock(&c, cur_dev, 0);
    pthread_mutex_unlock(&mu);
    unsigned long long lim = limit[cur_dev];
    unsigned long long free = used >= lim ? 0 : lim - used;
    if (*free_bytes < free) free = *free_bytes;
    *free_bytes = free;
    *total_bytes = lim;
    return rc;
}

static CUresult hook_total_mem(size_t *bytes, CUdevice dev) {
    CUresult rc = real_total_mem(bytes, dev);
    if (rc == CUDA_SUCCESS && dev >= 0 && dev < MAX_DEVICES && limit[dev] && limit[dev] < *bytes)
        *bytes = limit[dev];
    return rc;
}

static CUresult hook_mem_alloc(CUdeviceptr *dptr, size_t size) {
    if (!limited()) return real_mem_alloc(dptr, size);
    pthread_mutex_lock(&mu);
    cache_t c;
    unsigned long long used = cache_lock(&c, cur_dev) + own_usage(&c, cur_dev);
    CUresult rc;
    if (used + size > limit[cur_dev] + slack) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        cache_unlock(&c, cur_dev, 0);
    } else {
        rc = real_mem_alloc(dptr, size);
        cache_unlock(&c, cur_dev, rc == CUDA_SUCCESS ? (long long)size : 0);
        if (rc == CUDA_SUCCESS) {
            if (alloc_count == alloc_cap) {
                alloc_cap = alloc_cap ? alloc_cap * 2 : 64;
                allocs = realloc(allocs, alloc_cap * sizeof *allocs);
            }
            allocs[alloc_count].ptr = *dptr;
            allocs[alloc_count].size = size;
            alloc_count++;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult hook_mem_free(CUdeviceptr dptr) {
    CUresult rc = real_mem_free(dptr);
    if (rc != CUDA_SUCCESS || !limited()) return rc;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < alloc_count; i++) {
        if (allocs[i].ptr == dptr) {
            size_t size = allocs[i].size;
            allocs[i] = allocs[--alloc_count];
            cache_t c;
            cache_lock(&c, cur_dev);
            cache_unlock(&c, cur_dev, -(long long)size);
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

static void sleep_until(unsigned long long t) {
    struct timespec ts = {(time_t)(t / 1000000000ULL), (long)(t % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

static int turn_lock(void) {
    char path[700];
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    char key[64] = "";
    if (vis) { /* the GPU's host index: the cur_dev-th entry of CUDA_VISIBLE_DEVICES */
        char *copy = strdup(vis), *save = NULL, *tok = strtok_r(copy, ",", &save);
        for (int i = 0; tok && i < cur_dev; i++) tok = strtok_r(NULL, ",", &save);
        if (tok) snprintf(key, sizeof key, "%s", tok);
        free(copy);
    }
    if (!key[0]) snprintf(key, sizeof key, "%d", cur_dev);
    mkdir(lock_dir, 0777);
    snprintf(path, sizeof path, "%s/standin-vgpu-sm-%s.lock", lock_dir, key);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) flock(fd, LOCK_EX);
    return fd;
}

static CUresult hook_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, CUstream stream,
                            void **params, void **extra) {
    if (!sm_limit)
        return real_launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
    unsigned long long now = now_ns();
    if (!first_launch_ns) first_launch_ns = now;
    unsigned long long allowed_at = first_launch_ns + busy_ns * 100ULL / (unsigned)sm_limit;
    if (now < allowed_at) sleep_until(allowed_at);
    int fd = turn_lock();
    unsigned long long t0 = now_ns();
    CUresult rc = real_launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
    busy_ns += now_ns() - t0;
    if (fd >= 0) { flock(fd, LOCK_UN); close(fd); }
    return rc;
}

static void *hook_for(const char *name) {
    if (!name || name[0] != 'c' || name[1] != 'u') return NULL;
    if (!strcmp(name, "cuCtxCreate_v2")) return real_ctx_create ? (void *)hook_ctx_create : NULL;
    if (!strcmp(name, "cuCtxDestroy_v2")) return real_ctx_destroy ? (void *)hook_ctx_destroy : NULL;
    if (!strcmp(name, "cuDevicePrimaryCtxRetain"))
        return real_primary_retain ? (void *)hook_primary_retain : NULL;
    if (!strcmp(name, "cuDevicePrimaryCtxRelease_v2"))
        return real_primary_release ? (void *)hook_primary_release : NULL;
    if (!strcmp(name, "cuMemGetInfo_v2")) return real_mem_get_info ? (void *)hook_mem_get_info : NULL;
    if (!strcmp(name, "cuMemAlloc_v2")) return real_mem_alloc ? (void *)hook_mem_alloc : NULL;
    if (!strcmp(name, "cuMemFree_v2")) return real_mem_free ? (void *)hook_mem_free : NULL;
    if (!strcmp(name, "cuDeviceTotalMem_v2")) return real_total_mem ? (void *)hook_total_mem : NULL;
    if (!strcmp(name, "cuLaunchKernel")) return real_launch ? (void *)hook_launch : NULL;
    return NULL;
}

/* Exported under the driver's names, as HAMi-core's build exports its hooks (the agent refuses a
 * library that does not: HAMi-core finds its hooks by looking these names up in itself). */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    pthread_once(&once, init);
    return real_mem_alloc ? hook_mem_alloc(dptr, size) : 3; /* CUDA_ERROR_NOT_INITIALIZED */
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    pthread_once(&once, init);
    return real_mem_get_info ? hook_mem_get_info(free_bytes, total_bytes) : 3;
}

void *dlsym(void *handle, const char *name) {
    resolve_dlsym();
    if (name[0] == 'c' && name[1] == 'u') {
        pthread_once(&once, init);
        void *hook = hook_for(name);
        if (hook) return hook;
    }
    return real_dlsym(handle, name);
}
