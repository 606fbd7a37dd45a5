/* A fake libcuda.so.1 for the isolation-check tests: exactly the driver entry points the probe
 * (sharegpu.isolation_check.probe) uses, answering from environment variables and from state
 * shared between processes instead of a GPU.
 *
 *   FAKECUDA_GPUS        "NAME:MIB,NAME:MIB,..."  GPUs in index order (default "Fake GPU:16384")
 *   FAKECUDA_STATE_DIR   folder for the state shared by every process (default
 *                        /tmp/fakecuda-state): gpu<i>.mem holds each process's usage (flock'd,
 *                        per-pid records, dead pids ignored); gpu<i>.run is flock'd while a
 *                        kernel runs, so kernels of different processes take turns on one GPU
 *   FAKECUDA_CTX_MIB     memory a context takes (default 64)
 *   FAKECUDA_SMS         multiprocessors (default 132); 2048 threads each; clock 1 GHz, so one
 *                        cycle of the spin kernel is one nanosecond
 *   FAKECUDA_DRIVER_VERSION  cuDriverGetVersion (default 12020)
 *   CUDA_VISIBLE_DEVICES honoured (indices)
 *
 * A launch of the spin kernel runs synchronously: waves x cycles ns, where a wave is as many
 * blocks as the multiprocessors hold at once, holding the GPU's run lock.  Allocations fail with
 * CUDA_ERROR_OUT_OF_MEMORY past the GPU's size (summed over every process on the GPU).
 *
 * MPS client (FAKECUDA_MPS=1 and CUDA_MPS_PIPE_DIRECTORY naming an existing folder), as the MPS
 * documentation describes a client:
 *   CUDA_MPS_PINNED_DEVICE_MEM_LIMIT  "0=2048M,1=1G": this process may allocate that much on the
 *                        device (the context counts); cuMemGetInfo shows the limit in free, the
 *                        device's size in total
 *   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE  this process's kernels get that share of the SMs, so a
 *                        grid needs more waves; clients run side by side (no run lock)
 *   FAKECUDA_MPS_SLACK_MIB  misbehave: let a client allocate this much past its limit
 *   FAKECUDA_MPS_CTX_MIB    the memory a client's context takes (a real client's context is
 *                        smaller than a bare process's, and shrinks with its share of the SMs)
 *
 * A fatal fault: a module whose PTX holds "sharegpu-fault" has a kernel that faults. Its launch
 * returns CUDA_SUCCESS and every later launch and synchronize of that context fails with
 * CUDA_ERROR_ILLEGAL_ADDRESS, as a real context after an illegal address. An MPS client's fault
 * reaches every MPS client whose context was made before it on the same GPU (gpu<i>.fault counts
 * the faults), as the MPS documentation says of a fatal fault on Volta and later; a process
 * outside MPS faults alone, and a client made after the fault is not affected.
 *
 * Build: gcc -shared -fPIC -o libcuda.so.1 fakecuda.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
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
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_IMAGE 200
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_ILLEGAL_ADDRESS 700

#define MAX_GPUS 16
#define MAX_RECORDS 256
#define MIB (1024ULL * 1024ULL)
#define THREADS_PER_SM 2048
#define CLOCK_KHZ 1000000

typedef struct { char name[96]; unsigned long long bytes; } fake_gpu;
typedef struct { int32_t pid; int32_t unused; uint64_t bytes; } record;
typedef struct { CUdeviceptr ptr; size_t size; } allocation;

static fake_gpu gpus[MAX_GPUS];
static int gpu_count;
static int visible[MAX_GPUS];
static int visible_count;
static int initialised;
static char state_dir[512];
static unsigned long long ctx_bytes = 64 * MIB;
static int sms = 132;
static int driver_version = 12020;

static int mps;
static unsigned long long mps_limit[MAX_GPUS];
static double mps_pct = 100.0;
static unsigned long long mps_slack;

static int ctx_gpu = -1; /* host index of the current context's GPU, -1 without one */
static int ctx_ordinal = -1;
static unsigned long long own_bytes;
static allocation *allocs;
static size_t alloc_count, alloc_cap;
static CUdeviceptr next_ptr = 0x700000000000ULL;
static int run_fd = -1;
static char module_tag, function_tag;
static char fault_module_tag, fault_function_tag;
static int faulted;                   /* this context hit a fatal fault */
static unsigned long long ctx_faults; /* the GPU's MPS fault count when the context was made */

static unsigned long long parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    while (*end == ' ') end++;
    switch (*end) {
    case 'k': case 'K': v *= 1024.0; break;
    case 'm': case 'M': v *= (double)MIB; break;
    case 'g': case 'G': v *= (double)MIB * 1024.0; break;
    case 't': case 'T': v *= (double)MIB * 1024.0 * 1024.0; break;
    default: break;
    }
    return (unsigned long long)v;
}

static void add_gpu(const char *name, unsigned long long mib) {
    if (gpu_count >= MAX_GPUS) return;
    snprintf(gpus[gpu_count].name, sizeof gpus[gpu_count].name, "%s", name);
    gpus[gpu_count].bytes = mib * MIB;
    gpu_count++;
}

static void load_gpus(void) {
    const char *env = getenv("FAKECUDA_GPUS");
    if (!env || !*env) env = "Fake GPU:16384";
    char *copy = strdup(env), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *colon = strrchr(tok, ':');
        if (!colon) continue;
        *colon = 0;
        add_gpu(tok, strtoull(colon + 1, NULL, 10));
    }
    free(copy);
}

static void load_visible(void) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    visible_count = 0;
    if (!env) {
        for (int i = 0; i < gpu_count; i++) visible[visible_count++] = i;
        return;
    }
    /* like the driver: the list ends at the first entry that is not a GPU */
    char *copy = strdup(env), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long i = strtol(tok, &end, 10);
        if (end == tok || *end || i < 0 || i >= gpu_count) break;
        visible[visible_count++] = (int)i;
    }
    free(copy);
}

static void load_mps(void) {
    const char *on = getenv("FAKECUDA_MPS"), *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
    struct stat st;
    mps = on && !strcmp(on, "1") && pipe && stat(pipe, &st) == 0 && S_ISDIR(st.st_mode);
    if (!mps) return;
    const char *lim = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    if (lim) {
        char *copy = strdup(lim), *save = NULL;
        for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            char *eq = strchr(tok, '=');
            if (!eq) continue;
            int ordinal = atoi(tok);
            if (ordinal >= 0 && ordinal < MAX_GPUS) mps_limit[ordinal] = parse_size(eq + 1);
        }
        free(copy);
    }
    const char *pct = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    if (pct && atof(pct) > 0 && atof(pct) <= 100) mps_pct = atof(pct);
    const char *slack = getenv("FAKECUDA_MPS_SLACK_MIB");
    if (slack) mps_slack = strtoull(slack, NULL, 10) * MIB;
    const char *ctx = getenv("FAKECUDA_MPS_CTX_MIB");
    if (ctx) ctx_bytes = strtoull(ctx, NULL, 10) * MIB;
}

/* ---- state shared between processes ---- */

static int state_file(int gpu, const char *kind) {
    char path[640];
    mkdir(state_dir, 0777);
    snprintf(path, sizeof path, "%s/gpu%d.%s", state_dir, gpu, kind);
    return open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
}

static int alive(int32_t pid) {
    return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

/* Locks gpu<i>.mem; returns the fd (or -1) and every live process's usage in *used. */
static int mem_lock(int gpu, record *recs, unsigned long long *used) {
    int fd = state_file(gpu, "mem");
    if (fd < 0) return -1;
    flock(fd, LOCK_EX);
    memset(recs, 0, sizeof(record) * MAX_RECORDS);
    ssize_t n = pread(fd, recs, sizeof(record) * MAX_RECORDS, 0);
    (void)n;
    *used = 0;
    for (int i = 0; i < MAX_RECORDS; i++) {
        if (recs[i].pid == getpid()) continue;
        if (alive(recs[i].pid)) *used += recs[i].bytes;
        else recs[i].pid = 0, recs[i].bytes = 0;
    }
    return fd;
}

static void mem_unlock(int fd, record *recs, unsigned long long own) {
    int slot = -1;
    for (int i = 0; i < MAX_RECORDS; i++) {
        if (recs[i].pid == getpid()) { slot = i; break; }
        if (slot < 0 && recs[i].pid == 0) slot = i;
    }
    if (slot >= 0) {
        recs[slot].pid = own ? getpid() : 0;
        recs[slot].bytes = own;
    }
    ssize_t n = pwrite(fd, recs, sizeof(record) * MAX_RECORDS, 0);
    (void)n;
    flock(fd, LOCK_UN);
    close(fd);
}

static void sleep_ns(unsigned long long ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

/* ---- the driver API ---- */

CUresult cuInit(unsigned int flags) {
    (void)flags;
    if (initialised) return CUDA_SUCCESS;
    const char *dir = getenv("FAKECUDA_STATE_DIR");
    snprintf(state_dir, sizeof state_dir, "%s", dir && *dir ? dir : "/tmp/fakecuda-state");
    const char *c = getenv("FAKECUDA_CTX_MIB");
    if (c) ctx_bytes = strtoull(c, NULL, 10) * MIB;
    const char *s = getenv("FAKECUDA_SMS");
    if (s && atoi(s) > 0) sms = atoi(s);
    const char *v = getenv("FAKECUDA_DRIVER_VERSION");
    if (v && atoi(v) > 0) driver_version = atoi(v);
    load_gpus();
    load_visible();
    load_mps();
    if (visible_count == 0) return CUDA_ERROR_NO_DEVICE;
    initialised = 1;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    const char *v = getenv("FAKECUDA_DRIVER_VERSION");
    *version = v && atoi(v) > 0 ? atoi(v) : driver_version;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= visible_count) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static int host_index(CUdevice dev) {
    return dev >= 0 && dev < visible_count ? visible[dev] : -1;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    int g = host_index(dev);
    if (g < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", gpus[g].name);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    int g = host_index(dev);
    if (g < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = gpus[g].bytes;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (host_index(dev) < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    switch (attrib) {
    case 13: *value = CLOCK_KHZ; return CUDA_SUCCESS;      /* CLOCK_RATE */
    case 16: *value = sms; return CUDA_SUCCESS;            /* MULTIPROCESSOR_COUNT */
    case 39: *value = THREADS_PER_SM; return CUDA_SUCCESS; /* MAX_THREADS_PER_MULTIPROCESSOR */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static unsigned long long limit_of(void) {
    return mps && mps_limit[ctx_ordinal] ? mps_limit[ctx_ordinal] + mps_slack : 0;
}

/* Charges ``bytes`` to this process on the current GPU, if the GPU (and the MPS limit) has it. */
static CUresult charge(unsigned long long bytes) {
    record recs[MAX_RECORDS];
    unsigned long long used;
    int fd = mem_lock(ctx_gpu, recs, &used);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    unsigned long long limit = limit_of();
    if (used + own_bytes + bytes > gpus[ctx_gpu].bytes) rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (limit && own_bytes + bytes > limit) rc = CUDA_ERROR_OUT_OF_MEMORY;
    else own_bytes += bytes;
    mem_unlock(fd, recs, own_bytes);
    return rc;
}

static void uncharge(unsigned long long bytes) {
    record recs[MAX_RECORDS];
    unsigned long long used;
    int fd = mem_lock(ctx_gpu, recs, &used);
    own_bytes = bytes > own_bytes ? 0 : own_bytes - bytes;
    if (fd >= 0) mem_unlock(fd, recs, own_bytes);
}

/* The faults of MPS clients on ``gpu`` so far (gpu<i>.fault, a counter). */
static unsigned long long mps_faults(int gpu) {
    unsigned long long n = 0;
    int fd = state_file(gpu, "fault");
    if (fd < 0) return 0;
    flock(fd, LOCK_SH);
    ssize_t r = pread(fd, &n, sizeof n, 0);
    flock(fd, LOCK_UN);
    close(fd);
    return r == (ssize_t)sizeof n ? n : 0;
}

static void mps_fault(int gpu) {
    unsigned long long n = 0;
    int fd = state_file(gpu, "fault");
    if (fd < 0) return;
    flock(fd, LOCK_EX);
    if (pread(fd, &n, sizeof n, 0) != (ssize_t)sizeof n) n = 0;
    n++;
    ssize_t w = pwrite(fd, &n, sizeof n, 0);
    (void)w;
    flock(fd, LOCK_UN);
    close(fd);
}

/* Whether this context is dead of a fault: its own, or (MPS) another client's since it began. */
static int dead(void) {
    if (!faulted && mps && mps_faults(ctx_gpu) > ctx_faults) faulted = 1;
    return faulted;
}

CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    int g = host_index(dev);
    if (g < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (ctx_gpu >= 0) return CUDA_ERROR_INVALID_VALUE; /* one context per process here */
    ctx_gpu = g;
    ctx_ordinal = dev;
    faulted = 0;
    ctx_faults = mps_faults(g);
    CUresult rc = charge(ctx_bytes);
    if (rc != CUDA_SUCCESS) {
        ctx_gpu = ctx_ordinal = -1;
        return rc;
    }
    *ctx = (CUcontext)&ctx_gpu;
    return CUDA_SUCCESS;
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx != (CUcontext)&ctx_gpu || ctx_gpu < 0) return CUDA_ERROR_INVALID_CONTEXT;
    uncharge(own_bytes); /* the context and everything allocated in it */
    alloc_count = 0;
    if (run_fd >= 0) close(run_fd), run_fd = -1;
    ctx_gpu = ctx_ordinal = -1;
    return CUDA_SUCCESS;
}

/* The primary context (what the runtime API and frameworks use): one per process here too. */
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    return cuCtxCreate_v2(ctx, 0, dev);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    (void)dev;
    return cuCtxDestroy_v2((CUcontext)&ctx_gpu);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    return ctx == (CUcontext)&ctx_gpu && ctx_gpu >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuCtxSynchronize(void) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx_gpu < 0) return CUDA_ERROR_INVALID_CONTEXT;
    return dead() ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS; /* launches are synchronous */
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx_gpu < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    record recs[MAX_RECORDS];
    unsigned long long used;
    int fd = mem_lock(ctx_gpu, recs, &used);
    if (fd >= 0) mem_unlock(fd, recs, own_bytes);
    unsigned long long total = gpus[ctx_gpu].bytes, all = used + own_bytes;
    unsigned long long free = all >= total ? 0 : total - all;
    unsigned long long limit = mps && mps_limit[ctx_ordinal] ? mps_limit[ctx_ordinal] : 0;
    if (limit) {
        unsigned long long mine = own_bytes >= limit ? 0 : limit - own_bytes;
        if (mine < free) free = mine;
    }
    *free_bytes = free;
    *total_bytes = total;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx_gpu < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = charge(size);
    if (rc != CUDA_SUCCESS) return rc;
    if (alloc_count == alloc_cap) {
        alloc_cap = alloc_cap ? alloc_cap * 2 : 64;
        allocs = realloc(allocs, alloc_cap * sizeof *allocs);
    }
    allocs[alloc_count].ptr = next_ptr;
    allocs[alloc_count].size = size;
    alloc_count++;
    *dptr = next_ptr;
    next_ptr += (size + 0xfffff) & ~0xfffffULL;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx_gpu < 0) return CUDA_ERROR_INVALID_CONTEXT;
    for (size_t i = 0; i < alloc_count; i++) {
        if (allocs[i].ptr == dptr) {
            size_t size = allocs[i].size;
            allocs[i] = allocs[--alloc_count];
            uncharge(size);
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx_gpu < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    const char *ptx = image;
    if (!strstr(ptx, ".version") || !strstr(ptx, ".entry spin")) return CUDA_ERROR_INVALID_IMAGE;
    *module = strstr(ptx, "sharegpu-fault") ? &fault_module_tag : &module_tag;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *func, CUmodule module, const char *name) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (module != &module_tag && module != &fault_module_tag) return CUDA_ERROR_INVALID_HANDLE;
    if (!func || !name) return CUDA_ERROR_INVALID_VALUE;
    if (strcmp(name, "spin")) return CUDA_ERROR_NOT_FOUND;
    *func = module == &fault_module_tag ? &fault_function_tag : &function_tag;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, CUstream stream,
                        void **params, void **extra) {
    (void)shared, (void)stream, (void)extra;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx_gpu < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (f != &function_tag && f != &fault_function_tag) return CUDA_ERROR_INVALID_HANDLE;
    if (dead()) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (f == &fault_function_tag) { /* the fault shows at the next synchronize */
        faulted = 1;
        if (mps) mps_fault(ctx_gpu);
        return CUDA_SUCCESS;
    }
    unsigned long long blocks = (unsigned long long)gx * gy * gz;
    unsigned long long threads = (unsigned long long)bx * by * bz;
    if (!params || !params[0] || blocks == 0 || threads == 0 || threads > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t cycles = *(uint64_t *)params[0];
    double resident = (double)sms * (mps ? mps_pct / 100.0 : 1.0)
                      * (double)(THREADS_PER_SM / threads ? THREADS_PER_SM / threads : 1);
    double waves = ceil((double)blocks / resident);
    unsigned long long ns = (unsigned long long)(waves * (double)cycles * 1e6 / CLOCK_KHZ);
    if (mps) { /* MPS clients run side by side, each on its share of the SMs */
        sleep_ns(ns);
        return CUDA_SUCCESS;
    }
    if (run_fd < 0) run_fd = state_file(ctx_gpu, "run");
    if (run_fd >= 0) flock(run_fd, LOCK_EX);
    sleep_ns(ns);
    if (run_fd >= 0) flock(run_fd, LOCK_UN);
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *str = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *str = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *str = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *str = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *str = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *str = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_IMAGE: *str = "CUDA_ERROR_INVALID_IMAGE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *str = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *str = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_FOUND: *str = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *str = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    default: *str = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}
