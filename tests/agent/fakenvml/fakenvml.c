/* A fake libnvidia-ml.so.1 for tests: the NVML entry points sharegpu's agent reaches through
 * nvidia-ml-py, answering from environment variables instead of a driver.
 *
 *   FAKENVML_GPUS  "NAME:MIB,NAME:MIB,..."   GPUs in index order (default: two "Tesla T4:15109")
 *   FAKENVML_XID   "GPU:XID:DELAY_MS[:LOST_MS]"  one XID event on GPU, DELAY_MS after init; the
 *                  GPU then fails memory queries (GPU_IS_LOST) for LOST_MS
 *   FAKENVML_DRIVER  driver version string (default "535.104.05")
 *   FAKENVML_PROCS_FILE  a file read at every process query, one "GPU PID MIB" per line: the
 *                  compute processes running on each GPU and the memory each uses
 *
 * Build: gcc -shared -fPIC -o libnvidia-ml.so.1 fakenvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define XID_CRITICAL_EVENT 0x8ULL
#define MAX_GPUS 16

typedef struct fake_gpu {
    unsigned index;
    char name[96];
    char uuid[80];
    unsigned long long total;
} fake_gpu;

typedef struct { fake_gpu *device; unsigned long long type, data; unsigned gi, ci; } event_data;
typedef struct { unsigned long long total, free, used; } memory_info;
typedef struct { unsigned long long mask[MAX_GPUS]; } event_set;
typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} process_info;

static fake_gpu gpus[MAX_GPUS];
static unsigned gpu_count;
static int initialised;
static double t0;
static int xid_gpu = -1, xid_code;
static double xid_at, lost_until;
static int xid_sent;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000.0 + ts.tv_nsec / 1e6;
}

static void add_gpu(const char *name, unsigned long long mib) {
    if (gpu_count >= MAX_GPUS) return;
    fake_gpu *g = &gpus[gpu_count];
    g->index = gpu_count;
    snprintf(g->name, sizeof g->name, "%s", name);
    snprintf(g->uuid, sizeof g->uuid, "GPU-%08x-fa4e-4000-8000-%012x", 0xfa4e0000u + gpu_count,
             gpu_count);
    g->total = mib * 1024ULL * 1024ULL;
    gpu_count++;
}

static void configure(void) {
    gpu_count = 0;
    const char *spec = getenv("FAKENVML_GPUS");
    if (!spec || !*spec) spec = "Tesla T4:15109,Tesla T4:15109";
    char buf[2048];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *part = strtok_r(buf, ",", &save); part; part = strtok_r(NULL, ",", &save)) {
        char *colon = strrchr(part, ':');
        if (!colon) continue;
        *colon = 0;
        add_gpu(part, strtoull(colon + 1, NULL, 10));
    }
    xid_gpu = -1;
    xid_sent = 0;
    lost_until = 0;
    const char *x = getenv("FAKENVML_XID");
    if (x && *x) {
        int g = -1, code = 0;
        double delay = 0, lost = 0;
        if (sscanf(x, "%d:%d:%lf:%lf", &g, &code, &delay, &lost) >= 3) {
            xid_gpu = g;
            xid_code = code;
            xid_at = t0 + delay;
            lost_until = lost;  /* duration until the event fires */
        }
    }
}

static void copy_text(char *dst, unsigned len, const char *src) {
    snprintf(dst, len, "%s", src);
}

int nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    t0 = now_ms();
    configure();
    initialised = 1;
    return NVML_SUCCESS;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { initialised = 0; return NVML_SUCCESS; }

const char *nvmlErrorString(int result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *version, unsigned len) {
    const char *v = getenv("FAKENVML_DRIVER");
    copy_text(version, len, v && *v ? v : "535.104.05");
    return NVML_SUCCESS;
}

int nvmlDeviceGetCount_v2(unsigned *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *count = gpu_count;
    return NVML_SUCCESS;
}
int nvmlDeviceGetCount(unsigned *count) { return nvmlDeviceGetCount_v2(count); }

int nvmlDeviceGetHandleByIndex_v2(unsigned index, fake_gpu **device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

int nvmlDeviceGetName(fake_gpu *d, char *name, unsigned len) {
    copy_text(name, len, d->name);
    return NVML_SUCCESS;
}

int nvmlDeviceGetUUID(fake_gpu *d, char *uuid, unsigned len) {
    copy_text(uuid, len, d->uuid);
    return NVML_SUCCESS;
}

int nvmlDeviceGetMinorNumber(fake_gpu *d, unsigned *minor) {
    *minor = d->index;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMemoryInfo(fake_gpu *d, memory_info *m) {
    if (xid_sent && (int)d->index == xid_gpu && now_ms() < lost_until)
        return NVML_ERROR_GPU_IS_LOST;
    m->total = d->total;
    m->used = 0;
    m->free = d->total;
    return NVML_SUCCESS;
}

/* GPUs 0-1, 2-3, ... share a PCIe switch; the rest meet at the CPU socket. */
int nvmlDeviceGetTopologyCommonAncestor(fake_gpu *a, fake_gpu *b, int *level) {
    if (a == b) *level = 0;
    else if (a->index / 2 == b->index / 2) *level = 10;
    else *level = 40;
    return NVML_SUCCESS;
}

int nvmlEventSetCreate(event_set **set) {
    *set = calloc(1, sizeof(event_set));
    return *set ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

int nvmlDeviceRegisterEvents(fake_gpu *d, unsigned long long types, event_set *set) {
    set->mask[d->index] |= types;
    return NVML_SUCCESS;
}

int nvmlDeviceGetSupportedEventTypes(fake_gpu *d, unsigned long long *types) {
    (void)d;
    *types = XID_CRITICAL_EVENT;
    return NVML_SUCCESS;
}

int nvmlEventSetWait_v2(event_set *set, event_data *data, unsigned timeout_ms) {
    double deadline = now_ms() + timeout_ms;
    for (;;) {
        double t = now_ms();
        if (xid_gpu >= 0 && !xid_sent && t >= xid_at && xid_gpu < (int)gpu_count &&
            (set->mask[xid_gpu] & XID_CRITICAL_EVENT)) {
            xid_sent = 1;
            lost_until = t + lost_until;
            memset(data, 0, sizeof *data);
            data->device = &gpus[xid_gpu];
            data->type = XID_CRITICAL_EVENT;
            data->data = (unsigned long long)xid_code;
            return NVML_SUCCESS;
        }
        if (t >= deadline) return NVML_ERROR_TIMEOUT;
        usleep(10000);
    }
}
int nvmlEventSetWait(event_set *set, event_data *data, unsigned timeout_ms) {
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}

int nvmlEventSetFree(event_set *set) {
    free(set);
    return NVML_SUCCESS;
}

/* Compute processes of a GPU from FAKENVML_PROCS_FILE, as NVML answers them: with infos NULL
 * or too small, the count needed and INSUFFICIENT_SIZE (SUCCESS when there are none). */
int nvmlDeviceGetComputeRunningProcesses_v3(fake_gpu *d, unsigned *count, process_info *infos) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0, room = infos ? *count : 0;
    const char *path = getenv("FAKENVML_PROCS_FILE");
    FILE *f = path && *path ? fopen(path, "r") : NULL;
    if (f) {
        unsigned gpu, pid;
        unsigned long long mib;
        while (fscanf(f, "%u %u %llu", &gpu, &pid, &mib) == 3) {
            if (gpu != d->index) continue;
            if (n < room) {
                infos[n].pid = pid;
                infos[n].usedGpuMemory = mib * 1024ULL * 1024ULL;
                infos[n].gpuInstanceId = 0xFFFFFFFFu;
                infos[n].computeInstanceId = 0xFFFFFFFFu;
            }
            n++;
        }
        fclose(f);
    }
    *count = n;
    if (n > room) return NVML_ERROR_INSUFFICIENT_SIZE;
    return NVML_SUCCESS;
}
int nvmlDeviceGetComputeRunningProcesses_v2(fake_gpu *d, unsigned *count, process_info *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(d, count, infos);
}
