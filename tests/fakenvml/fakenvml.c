/* A stand-in for libnvidia-ml.so.1: serves the NVML calls tfprofd makes from a JSON state file.
 *
 * The file is named by $FAKE_NVML_STATE and re-read whenever it changes (mtime, size or inode), so a
 * test scripts a GPU by rewriting it. Keys are documented in README.md beside this file. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <limits.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    OK = 0, ERR_UNINITIALIZED = 1, ERR_INVALID_ARGUMENT = 2, ERR_NOT_SUPPORTED = 3, ERR_NO_PERMISSION = 4,
    ERR_NOT_FOUND = 6, ERR_INSUFFICIENT_SIZE = 7, ERR_DRIVER_NOT_LOADED = 9, ERR_TIMEOUT = 10,
    ERR_GPU_IS_LOST = 15, ERR_UNKNOWN = 999
};
#define MAX_GPUS 64
#define XID_EVENT 0x8ULL

/* ---- a minimal JSON reader: enough for the state file ---- */
typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;
typedef struct jnode {
    jtype type;
    double num;
    char *str;             /* J_STR value, or the key when inside an object */
    char *key;
    struct jnode *child;   /* first element / member */
    struct jnode *next;
} jnode;

static const char *jp;
static int jerr;

static void jskip(void) { while (*jp == ' ' || *jp == '\n' || *jp == '\r' || *jp == '\t') jp++; }

static char *jstring(void) {
    if (*jp != '"') { jerr = 1; return NULL; }
    jp++;
    const char *start = jp;
    size_t cap = 16, len = 0;
    char *out = malloc(cap);
    while (*jp && *jp != '"') {
        char c = *jp++;
        if (c == '\\' && *jp) {
            c = *jp++;
            if (c == 'n') c = '\n'; else if (c == 't') c = '\t';
            else if (c == 'u') { c = '?'; for (int i = 0; i < 4 && *jp; i++) jp++; }
        }
        if (len + 2 > cap) { cap *= 2; out = realloc(out, cap); }
        out[len++] = c;
    }
    (void)start;
    if (*jp != '"') { jerr = 1; free(out); return NULL; }
    jp++;
    out[len] = 0;
    return out;
}

static jnode *jvalue(void);

static jnode *jnew(jtype t) { jnode *n = calloc(1, sizeof *n); n->type = t; return n; }

static jnode *jcontainer(jtype t, char close) {
    jnode *n = jnew(t), **tail = &n->child;
    jp++;
    jskip();
    if (*jp == close) { jp++; return n; }
    for (;;) {
        jskip();
        char *key = NULL;
        if (t == J_OBJ) {
            key = jstring();
            if (jerr) return n;
            jskip();
            if (*jp != ':') { jerr = 1; free(key); return n; }
            jp++;
        }
        jnode *v = jvalue();
        if (!v) { free(key); return n; }
        v->key = key;
        *tail = v;
        tail = &v->next;
        jskip();
        if (*jp == ',') { jp++; continue; }
        if (*jp == close) { jp++; return n; }
        jerr = 1;
        return n;
    }
}

static jnode *jvalue(void) {
    jskip();
    if (*jp == '{') return jcontainer(J_OBJ, '}');
    if (*jp == '[') return jcontainer(J_ARR, ']');
    if (*jp == '"') { jnode *n = jnew(J_STR); n->str = jstring(); return n; }
    if (!strncmp(jp, "true", 4)) { jp += 4; jnode *n = jnew(J_BOOL); n->num = 1; return n; }
    if (!strncmp(jp, "false", 5)) { jp += 5; return jnew(J_BOOL); }
    if (!strncmp(jp, "null", 4)) { jp += 4; return jnew(J_NULL); }
    char *end;
    double d = strtod(jp, &end);
    if (end == jp) { jerr = 1; return NULL; }
    jp = end;
    jnode *n = jnew(J_NUM);
    n->num = d;
    return n;
}

static void jfree(jnode *n) {
    while (n) {
        jnode *next = n->next;
        jfree(n->child);
        free(n->str);
        free(n->key);
        free(n);
        n = next;
    }
}

static jnode *jget(const jnode *obj, const char *key) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (jnode *c = obj->child; c; c = c->next)
        if (c->key && !strcmp(c->key, key)) return c;
    return NULL;
}

static jnode *jat(const jnode *arr, int i) {
    if (!arr || arr->type != J_ARR) return NULL;
    jnode *c = arr->child;
    while (c && i-- > 0) c = c->next;
    return c;
}

static int jlen(const jnode *arr) {
    int n = 0;
    if (arr && arr->type == J_ARR) for (jnode *c = arr->child; c; c = c->next) n++;
    return n;
}

/* ---- state ---- */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static jnode *state;
static int state_present;
static struct stat state_stat;
static int initialized;
static double init_generation; /* the state's "generation" when nvmlInit ran: a new one is a driver reload */
static unsigned xid_delivered[MAX_GPUS];

static int code_of(const char *name) {
    if (!strcmp(name, "gpu_is_lost")) return ERR_GPU_IS_LOST;
    if (!strcmp(name, "not_supported")) return ERR_NOT_SUPPORTED;
    if (!strcmp(name, "driver_not_loaded")) return ERR_DRIVER_NOT_LOADED;
    if (!strcmp(name, "not_found")) return ERR_NOT_FOUND;
    if (!strcmp(name, "no_permission")) return ERR_NO_PERMISSION;
    if (!strcmp(name, "uninitialized")) return ERR_UNINITIALIZED;
    return ERR_UNKNOWN;
}

/* Re-reads the state file if it changed; caller holds the lock. */
static void refresh(void) {
    const char *path = getenv("FAKE_NVML_STATE");
    struct stat st;
    if (!path || stat(path, &st) != 0) {
        state_present = 0;
        return;
    }
    if (state_present && st.st_ino == state_stat.st_ino && st.st_size == state_stat.st_size &&
        st.st_mtim.tv_sec == state_stat.st_mtim.tv_sec && st.st_mtim.tv_nsec == state_stat.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(path, "rb");
    if (!f) { state_present = 0; return; }
    char *buf = malloc(st.st_size + 1);
    size_t got = fread(buf, 1, st.st_size, f);
    fclose(f);
    buf[got] = 0;
    jp = buf;
    jerr = 0;
    jnode *parsed = jvalue();
    free(buf);
    if (jerr || !parsed || parsed->type != J_OBJ) {
        /* A half-written file: keep the last good state and try again on the next call. */
        jfree(parsed);
        return;
    }
    jfree(state);
    state = parsed;
    state_present = 1;
    state_stat = st;
}

static int gpu_count(void) { return jlen(jget(state, "gpus")); }

static double num_or(const jnode *obj, const char *key, double dflt) {
    const jnode *n = jget(obj, key);
    return n && (n->type == J_NUM || n->type == J_BOOL) ? n->num : dflt;
}

static const char *str_or(const jnode *obj, const char *key, const char *dflt) {
    const jnode *n = jget(obj, key);
    return n && n->type == J_STR ? n->str : dflt;
}

/* The error a field answers with: listed in "unsupported", or named in the "errors" object. */
static nvmlReturn_t field_error(const jnode *gpu, const char *field) {
    const jnode *list = jget(gpu, "unsupported");
    for (int i = 0; i < jlen(list); i++) {
        const jnode *s = jat(list, i);
        if (s->type == J_STR && !strcmp(s->str, field)) return ERR_NOT_SUPPORTED;
    }
    const char *err = str_or(jget(gpu, "errors"), field, NULL);
    return err ? code_of(err) : OK;
}

/* Handles: 0x1000 + index for a GPU; 0x100000 + 256 * index + slot for the MIG device in that slot. */
#define MIG_BASE 0x100000
static int is_mig(void *device) { return (uintptr_t)device >= MIG_BASE; }
static int handle_index(void *device) {
    uintptr_t h = (uintptr_t)device;
    return h >= MIG_BASE ? (int)((h - MIG_BASE) / 256) : (int)(h - 0x1000);
}
static int mig_slot(void *device) { return (int)(((uintptr_t)device - MIG_BASE) % 256); }
static int mig_enabled(const jnode *gpu) { return num_or(jget(gpu, "mig"), "mode", 0) == 1; }
static const jnode *mig_instance(const jnode *gpu, int slot) {
    return mig_enabled(gpu) ? jat(jget(jget(gpu, "mig"), "instances"), slot) : NULL;
}

/* Sleeps for the GPU's "delay_ms" (a hung driver call), without holding the lock. */
static void delay(void *device) {
    pthread_mutex_lock(&lock);
    refresh();
    const jnode *gpu = state_present ? jat(jget(state, "gpus"), handle_index(device)) : NULL;
    double ms = gpu ? num_or(gpu, "delay_ms", 0) : 0;
    pthread_mutex_unlock(&lock);
    if (ms > 0) {
        struct timespec ts = {(time_t)(ms / 1000), (long)((ms - 1000 * (long)(ms / 1000)) * 1e6)};
        nanosleep(&ts, NULL);
    }
}

/* Locks, refreshes and resolves the device; on success returns OK with the lock held. */
static nvmlReturn_t enter(void *device, const char *field, const jnode **gpu_out) {
    delay(device);
    pthread_mutex_lock(&lock);
    if (!initialized) { pthread_mutex_unlock(&lock); return ERR_UNINITIALIZED; }
    refresh();
    if (!state_present) { pthread_mutex_unlock(&lock); return ERR_GPU_IS_LOST; }
    if (num_or(state, "generation", 0) != init_generation) { pthread_mutex_unlock(&lock); return ERR_UNINITIALIZED; }
    int idx = handle_index(device);
    const jnode *gpu = jat(jget(state, "gpus"), idx);
    if (idx < 0 || !gpu) { pthread_mutex_unlock(&lock); return ERR_GPU_IS_LOST; }
    const char *err = str_or(gpu, "error", NULL);
    if (err) { pthread_mutex_unlock(&lock); return code_of(err); }
    nvmlReturn_t rc = field ? field_error(gpu, field) : OK;
    if (rc != OK) { pthread_mutex_unlock(&lock); return rc; }
    if (is_mig(device)) {
        const jnode *mig = mig_instance(gpu, mig_slot(device));
        if (!mig) { pthread_mutex_unlock(&lock); return ERR_INVALID_ARGUMENT; }
        /* a MIG device answers identity, memory and instance ids; the rest is the parent's */
        if (field && strcmp(field, "memory") && strcmp(field, "mig")) {
            pthread_mutex_unlock(&lock);
            return ERR_NOT_SUPPORTED;
        }
        *gpu_out = mig;
        return OK;
    }
    /* in MIG mode the whole GPU's utilization is not reported (as on real hardware) */
    if (field && !strcmp(field, "utilization") && mig_enabled(gpu)) { pthread_mutex_unlock(&lock); return ERR_NOT_SUPPORTED; }
    *gpu_out = gpu;
    return OK;
}

static void leave(void) { pthread_mutex_unlock(&lock); }

static void copy_str(char *dst, unsigned size, const char *src) {
    if (!size) return;
    snprintf(dst, size, "%s", src);
}

/* ---- the NVML API ---- */
nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    refresh();
    nvmlReturn_t rc = OK;
    if (!state_present) rc = ERR_DRIVER_NOT_LOADED;
    else if (str_or(state, "init_error", NULL)) rc = code_of(str_or(state, "init_error", ""));
    else { initialized = 1; init_generation = num_or(state, "generation", 0); }
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    initialized = 0;
    pthread_mutex_unlock(&lock);
    return OK;
}

const char *nvmlErrorString(nvmlReturn_t rc) {
    switch (rc) {
    case OK: return "Success";
    case ERR_UNINITIALIZED: return "Uninitialized";
    case ERR_NOT_SUPPORTED: return "Not Supported";
    case ERR_NO_PERMISSION: return "Insufficient Permissions";
    case ERR_INVALID_ARGUMENT: return "Invalid Argument";
    case ERR_NOT_FOUND: return "Not Found";
    case ERR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case ERR_TIMEOUT: return "Timeout";
    case ERR_GPU_IS_LOST: return "GPU is lost";
    case ERR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned length) {
    pthread_mutex_lock(&lock);
    refresh();
    copy_str(version, length, str_or(state, "driver_version", "550.54.15"));
    pthread_mutex_unlock(&lock);
    return OK;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = OK;
    refresh();
    if (!initialized) rc = ERR_UNINITIALIZED;
    else if (!state_present) rc = ERR_UNKNOWN;
    else if (num_or(state, "generation", 0) != init_generation) rc = ERR_UNINITIALIZED;
    else *count = (unsigned)gpu_count();
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, void **device) {
    pthread_mutex_lock(&lock);
    refresh();
    nvmlReturn_t rc = OK;
    if (!initialized) rc = ERR_UNINITIALIZED;
    else if (!state_present) rc = ERR_GPU_IS_LOST;
    else if ((int)index >= gpu_count()) rc = ERR_INVALID_ARGUMENT;
    else *device = (void *)(uintptr_t)(0x1000 + index);
    pthread_mutex_unlock(&lock);
    return rc;
}

#define DEVICE_GETTER(fname, field, ...)                               \
    nvmlReturn_t fname {                                               \
        const jnode *gpu;                                              \
        nvmlReturn_t rc = enter(device, field, &gpu);                  \
        if (rc != OK) return rc;                                       \
        __VA_ARGS__;                                                   \
        leave();                                                       \
        return OK;                                                     \
    }

DEVICE_GETTER(nvmlDeviceGetName(void *device, char *name, unsigned length), NULL, {
    if (is_mig(device)) {
        const jnode *parent = jat(jget(state, "gpus"), handle_index(device));
        snprintf(name, length, "%s MIG %s", str_or(parent, "name", "NVIDIA H100 80GB HBM3"),
                 str_or(gpu, "profile", "1g.10gb"));
    } else {
        copy_str(name, length, str_or(gpu, "name", "NVIDIA H100 80GB HBM3"));
    }
})
/* The /dev/nvidiaN number: "minor_number", else the GPU's index (as on most hosts, not all). */
DEVICE_GETTER(nvmlDeviceGetMinorNumber(void *device, unsigned *minor), "minor_number",
              *minor = (unsigned)num_or(gpu, "minor_number", handle_index(device)))
DEVICE_GETTER(nvmlDeviceGetUUID(void *device, char *uuid, unsigned length), NULL,
              copy_str(uuid, length, str_or(gpu, "uuid", "GPU-00000000-0000-0000-0000-000000000000")))

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

DEVICE_GETTER(nvmlDeviceGetPciInfo_v3(void *device, nvmlPciInfo_t *pci), NULL, {
    memset(pci, 0, sizeof *pci);
    copy_str(pci->busId, sizeof pci->busId, str_or(gpu, "pci_bus_id", "00000000:00:00.0"));
    copy_str(pci->busIdLegacy, sizeof pci->busIdLegacy, str_or(gpu, "pci_bus_id", "0000:00:00.0"));
})

typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
DEVICE_GETTER(nvmlDeviceGetUtilizationRates(void *device, nvmlUtilization_t *u), "utilization", {
    u->gpu = (unsigned)num_or(gpu, "utilization_gpu", 0);
    u->memory = (unsigned)num_or(gpu, "utilization_memory", 0);
})

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
DEVICE_GETTER(nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *m), "memory", {
    m->total = (unsigned long long)num_or(gpu, "memory_total_bytes", 85899345920.0);
    m->used = (unsigned long long)num_or(gpu, "memory_used_bytes", 0);
    m->free = m->total > m->used ? m->total - m->used : 0;
})

DEVICE_GETTER(nvmlDeviceGetTemperature(void *device, int sensor, unsigned *temp), "temperature", {
    (void)sensor;
    *temp = (unsigned)num_or(gpu, "temperature_celsius", 40);
})
DEVICE_GETTER(nvmlDeviceGetPowerUsage(void *device, unsigned *mw), "power",
              *mw = (unsigned)num_or(gpu, "power_milliwatts", 70000))
DEVICE_GETTER(nvmlDeviceGetTotalEnergyConsumption(void *device, unsigned long long *mj), "energy",
              *mj = (unsigned long long)num_or(gpu, "energy_millijoules", 0))
DEVICE_GETTER(nvmlDeviceGetClockInfo(void *device, int type, unsigned *mhz), "clocks",
              *mhz = (unsigned)num_or(gpu, type == 1 ? "sm_clock_mhz" : "memory_clock_mhz", 0))
DEVICE_GETTER(nvmlDeviceGetCurrentClocksEventReasons(void *device, unsigned long long *reasons),
              "clocks_event_reasons",
              *reasons = (unsigned long long)num_or(gpu, "clocks_event_reasons", 0))
DEVICE_GETTER(nvmlDeviceGetPcieThroughput(void *device, int counter, unsigned *kbps), "pcie",
              *kbps = (unsigned)num_or(gpu, counter == 0 ? "pcie_tx_kbps" : "pcie_rx_kbps", 0))
DEVICE_GETTER(nvmlDeviceGetTotalEccErrors(void *device, int error_type, int counter_type,
                                          unsigned long long *count), "ecc", {
    (void)counter_type;
    *count = (unsigned long long)num_or(gpu, error_type == 0 ? "ecc_corrected" : "ecc_uncorrected", 0);
})
DEVICE_GETTER(nvmlDeviceGetSupportedEventTypes(void *device, unsigned long long *types), "events",
              *types = XID_EVENT)

typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned *count, nvmlProcessInfo_t *infos) {
    const jnode *gpu;
    nvmlReturn_t rc = enter(device, "processes", &gpu);
    if (rc != OK) return rc;
    const jnode *procs = jget(gpu, "processes");
    unsigned n = (unsigned)jlen(procs);
    if (n == 0) { *count = 0; leave(); return OK; }
    if (!infos || *count < n) { *count = n; leave(); return ERR_INSUFFICIENT_SIZE; }
    for (unsigned i = 0; i < n; i++) {
        const jnode *p = jat(procs, (int)i);
        infos[i].pid = (unsigned)num_or(p, "pid", 0);
        infos[i].usedGpuMemory = (unsigned long long)num_or(p, "used_memory_bytes", 0);
        infos[i].gpuInstanceId = (unsigned)num_or(p, "gpu_instance_id", 0xFFFFFFFF);
        infos[i].computeInstanceId = (unsigned)num_or(p, "compute_instance_id", 0xFFFFFFFF);
    }
    *count = n;
    leave();
    return OK;
}

/* ---- XID events: each entry of a GPU's "xid_events" list is delivered once, in order ---- */
typedef struct {
    unsigned long long mask[MAX_GPUS];
    int watch;  /* inotify on the state file's directory (-1: none), for the set's lifetime */
} event_set;

typedef struct {
    void *device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

/* An inotify watch on the state file's directory (the file is replaced, written or removed there), or -1. */
static int watch_state(void) {
    const char *path = getenv("FAKE_NVML_STATE");
    if (!path) return -1;
    char dir[4096];
    const char *slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 0;
    if (len >= sizeof dir) return -1;
    memcpy(dir, path, len);
    dir[len] = 0;
    if (!slash) strcpy(dir, ".");
    else if (!len) strcpy(dir, "/");
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd >= 0 && inotify_add_watch(fd, dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM |
                                              IN_DELETE_SELF | IN_MOVE_SELF) < 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

nvmlReturn_t nvmlEventSetCreate(event_set **set) {
    *set = calloc(1, sizeof **set);
    if (!*set) return ERR_UNKNOWN;
    (*set)->watch = watch_state();
    return OK;
}

nvmlReturn_t nvmlEventSetFree(event_set *set) {
    if (set->watch >= 0) close(set->watch);
    free(set);
    return OK;
}

nvmlReturn_t nvmlDeviceRegisterEvents(void *device, unsigned long long types, event_set *set) {
    const jnode *gpu;
    nvmlReturn_t rc = enter(device, "events", &gpu);
    if (rc != OK) return rc;
    int idx = handle_index(device);
    if (idx < MAX_GPUS) set->mask[idx] |= types & XID_EVENT;
    leave();
    return OK;
}

static int next_event(event_set *set, nvmlEventData_t *data) {
    const jnode *gpus = jget(state, "gpus");
    for (int i = 0; i < jlen(gpus) && i < MAX_GPUS; i++) {
        if (!(set->mask[i] & XID_EVENT)) continue;
        const jnode *events = jget(jat(gpus, i), "xid_events");
        if ((unsigned)jlen(events) <= xid_delivered[i]) continue;
        data->device = (void *)(uintptr_t)(0x1000 + i);
        data->eventType = XID_EVENT;
        data->eventData = (unsigned long long)jat(events, (int)xid_delivered[i])->num;
        data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFF;
        xid_delivered[i]++;
        return 1;
    }
    return 0;
}

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000LL + t.tv_nsec / 1000000;
}

/* Blocks until an event is due or the timeout, as the driver does: woken by a change to the state file, not
 * by polling it (a 100 ms poll here cost the agent's process a quarter of a percent of a core, which real
 * NVML, waiting in the kernel, does not). Without inotify it polls every 100 ms. */
/* Waits on the set's watch for a change, at most ``ms``; stops watching (polls from then on) once the watched
 * directory is gone. */
static void wait_for_change(event_set *set, long long ms) {
    struct pollfd p = {set->watch, POLLIN, 0};
    char events[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    if (poll(&p, 1, ms > INT_MAX ? INT_MAX : (int)ms) <= 0) return;
    ssize_t n;
    while ((n = read(set->watch, events, sizeof events)) > 0)
        for (char *e = events; e < events + n; e += sizeof(struct inotify_event) + ((struct inotify_event *)e)->len)
            if (((struct inotify_event *)e)->mask & IN_IGNORED) {  /* the directory went */
                close(set->watch);
                set->watch = -1;
                return;
            }
}

nvmlReturn_t nvmlEventSetWait_v2(event_set *set, nvmlEventData_t *data, unsigned timeout_ms) {
    /* watching since the set was made, so a change made after a look wakes the wait */
    long long deadline = now_ms() + timeout_ms;
    for (;;) {
        pthread_mutex_lock(&lock);
        refresh();
        int got = state_present && initialized && next_event(set, data);
        int lost = !state_present;
        pthread_mutex_unlock(&lock);
        long long left = deadline - now_ms();
        if (got) return OK;
        if (lost) return ERR_GPU_IS_LOST;
        if (left <= 0) return ERR_TIMEOUT;
        if (set->watch >= 0) {
            wait_for_change(set, left);
        } else {
            struct timespec step = {0, (left < 100 ? left : 100) * 1000 * 1000};
            nanosleep(&step, NULL);
        }
    }
}

/* ---- health: remapped rows, retired pages, field values (recovery action, NVLink) ---- */
DEVICE_GETTER(nvmlDeviceGetRemappedRows(void *device, unsigned *corr, unsigned *unc, unsigned *pending,
                                        unsigned *failure), "remapped_rows", {
    const jnode *r = jget(gpu, "remapped_rows");
    if (!r) { leave(); return ERR_NOT_SUPPORTED; }
    *corr = (unsigned)num_or(r, "correctable", 0);
    *unc = (unsigned)num_or(r, "uncorrectable", 0);
    *pending = (unsigned)num_or(r, "pending", 0);
    *failure = (unsigned)num_or(r, "failure", 0);
})

nvmlReturn_t nvmlDeviceGetRetiredPages(void *device, int cause, unsigned *count, unsigned long long *addresses) {
    const jnode *gpu;
    nvmlReturn_t rc = enter(device, "retired_pages", &gpu);
    if (rc != OK) return rc;
    const jnode *r = jget(gpu, "retired_pages");
    if (!r) { leave(); return ERR_NOT_SUPPORTED; }
    unsigned n = (unsigned)num_or(r, cause == 0 ? "single_bit" : "double_bit", 0);
    if (!addresses || *count < n) { *count = n; leave(); return n ? ERR_INSUFFICIENT_SIZE : OK; }
    for (unsigned i = 0; i < n; i++) addresses[i] = 0x1000ULL * (i + 1);
    *count = n;
    leave();
    return OK;
}

DEVICE_GETTER(nvmlDeviceGetRetiredPagesPendingStatus(void *device, int *pending), "retired_pages", {
    const jnode *r = jget(gpu, "retired_pages");
    if (!r) { leave(); return ERR_NOT_SUPPORTED; }
    *pending = (int)num_or(r, "pending", 0);
})

DEVICE_GETTER(nvmlDeviceGetNvLinkState(void *device, unsigned link, unsigned *active), "nvlink", {
    const jnode *l = jat(jget(gpu, "nvlinks"), (int)link);
    if (!jget(gpu, "nvlinks")) { leave(); return ERR_NOT_SUPPORTED; }
    if (!l) { leave(); return ERR_INVALID_ARGUMENT; }
    *active = (unsigned)num_or(l, "active", 1);
})

typedef struct {
    unsigned fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    union { double d; unsigned long long ull; } value;
} nvmlFieldValue_t;

enum { FI_NVLINK_CRC_FLIT = 38, FI_NVLINK_CRC_DATA = 45, FI_NVLINK_REPLAY = 52, FI_NVLINK_RECOVERY = 59,
       FI_NVLINK_TX = 138, FI_NVLINK_RX = 139, FI_RECOVERY_ACTION = 230 };

static int field_value(const jnode *gpu, nvmlFieldValue_t *v) {
    const jnode *errors = jget(gpu, "nvlink_errors"), *links = jget(gpu, "nvlinks"), *n = NULL;
    switch (v->fieldId) {
    case FI_NVLINK_CRC_FLIT: n = jget(errors, "crc_flit"); break;
    case FI_NVLINK_CRC_DATA: n = jget(errors, "crc_data"); break;
    case FI_NVLINK_REPLAY: n = jget(errors, "replay"); break;
    case FI_NVLINK_RECOVERY: n = jget(errors, "recovery"); break;
    case FI_NVLINK_TX: n = jget(jat(links, (int)v->scopeId), "tx_kib"); break;
    case FI_NVLINK_RX: n = jget(jat(links, (int)v->scopeId), "rx_kib"); break;
    case FI_RECOVERY_ACTION: n = jget(gpu, "recovery_action"); break;
    }
    if (!n || n->type != J_NUM) return ERR_NOT_SUPPORTED;
    v->valueType = 3; /* unsigned long long */
    v->value.ull = (unsigned long long)n->num;
    return OK;
}

nvmlReturn_t nvmlDeviceGetFieldValues(void *device, int count, nvmlFieldValue_t *values) {
    const jnode *gpu;
    nvmlReturn_t rc = enter(device, "field_values", &gpu);
    if (rc != OK) return rc;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < count; i++) {
        values[i].timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        values[i].latencyUsec = 0;
        values[i].nvmlReturn = field_value(gpu, &values[i]);
    }
    leave();
    return OK;
}

/* ---- MIG ---- */
DEVICE_GETTER(nvmlDeviceGetMigMode(void *device, unsigned *current, unsigned *pending), "mig", {
    const jnode *mig = jget(gpu, "mig");
    if (!mig) { leave(); return ERR_NOT_SUPPORTED; }
    *current = *pending = (unsigned)num_or(mig, "mode", 0);
})

DEVICE_GETTER(nvmlDeviceGetMaxMigDeviceCount(void *device, unsigned *count), "mig", {
    if (!jget(gpu, "mig")) { leave(); return ERR_NOT_SUPPORTED; }
    *count = 7;
})

DEVICE_GETTER(nvmlDeviceGetMigDeviceHandleByIndex(void *device, unsigned index, void **mig), "mig", {
    if (!mig_instance(gpu, (int)index)) { leave(); return ERR_NOT_FOUND; }
    *mig = (void *)(uintptr_t)(MIG_BASE + 256 * handle_index(device) + index);
})

DEVICE_GETTER(nvmlDeviceGetGpuInstanceId(void *device, unsigned *id), "mig", {
    if (!is_mig(device)) { leave(); return ERR_INVALID_ARGUMENT; }
    *id = (unsigned)num_or(gpu, "gpu_instance_id", 0);
})

DEVICE_GETTER(nvmlDeviceGetComputeInstanceId(void *device, unsigned *id), "mig", {
    if (!is_mig(device)) { leave(); return ERR_INVALID_ARGUMENT; }
    *id = (unsigned)num_or(gpu, "compute_instance_id", 0);
})

/* ---- GPM: a sample keeps the readings of its moment; metrics are those of the second sample ---- */
typedef struct { int taken; double values[16]; int present[16]; } gpm_sample;

typedef struct {
    unsigned metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    const char *shortName, *longName, *unit;
} nvmlGpmMetric_t;

typedef struct {
    unsigned version, numMetrics;
    gpm_sample *sample1, *sample2;
    nvmlGpmMetric_t metrics[477];
} nvmlGpmMetricsGet_t;

typedef struct { unsigned version, isSupportedDevice; } nvmlGpmSupport_t;

static const char *gpm_keys[16] = {
    NULL, "graphics_activity", "sm_activity", "sm_occupancy", NULL, "tensor_activity", NULL, NULL, NULL, NULL,
    "dram_bandwidth", NULL, NULL, NULL, NULL, NULL};

DEVICE_GETTER(nvmlGpmQueryDeviceSupport(void *device, nvmlGpmSupport_t *support), "gpm",
              support->isSupportedDevice = jget(gpu, "gpm") != NULL)

nvmlReturn_t nvmlGpmSampleAlloc(gpm_sample **sample) {
    *sample = calloc(1, sizeof **sample);
    return OK;
}

nvmlReturn_t nvmlGpmSampleFree(gpm_sample *sample) {
    free(sample);
    return OK;
}

static void gpm_take(const jnode *readings, gpm_sample *sample) {
    sample->taken = 1;
    for (int i = 0; i < 16; i++) {
        const jnode *n = gpm_keys[i] ? jget(readings, gpm_keys[i]) : NULL;
        sample->present[i] = n && n->type == J_NUM;
        sample->values[i] = sample->present[i] ? n->num : 0;
    }
}

DEVICE_GETTER(nvmlGpmSampleGet(void *device, gpm_sample *sample), "gpm", {
    if (!jget(gpu, "gpm")) { leave(); return ERR_NOT_SUPPORTED; }
    gpm_take(jget(gpu, "gpm"), sample);
})

DEVICE_GETTER(nvmlGpmMigSampleGet(void *device, unsigned gpu_instance_id, gpm_sample *sample), "gpm", {
    const jnode *instances = jget(jget(gpu, "mig"), "instances"), *found = NULL;
    for (int i = 0; i < jlen(instances) && !found; i++)
        if (num_or(jat(instances, i), "gpu_instance_id", -1) == gpu_instance_id) found = jat(instances, i);
    if (!found || !jget(gpu, "gpm")) { leave(); return ERR_NOT_FOUND; }
    gpm_take(jget(found, "gpm"), sample);
})

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *get) {
    if (!get || get->version != 1 || !get->sample1 || !get->sample2 || get->sample1 == get->sample2 ||
        !get->sample1->taken || !get->sample2->taken || get->numMetrics > 477)
        return ERR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < get->numMetrics; i++) {
        unsigned id = get->metrics[i].metricId;
        int ok = id < 16 && get->sample2->present[id];
        get->metrics[i].nvmlReturn = ok ? OK : ERR_NOT_SUPPORTED;
        get->metrics[i].value = ok ? get->sample2->values[id] : 0;
    }
    return OK;
}
