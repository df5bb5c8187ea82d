/* Host memory bandwidth with n pinned threads streaming through one buffer (probe.py sizes
 * the worker pool with it: the fewest threads near the best bandwidth). */
typedef struct {
    const uint64_t *buf; size_t words; int cpu, reps;
    int *go;
    uint64_t sum;
} probe_arg;

static void *probe_thread(void *arg) {
    probe_arg *a = arg;
    if (a->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(a->cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    while (!__atomic_load_n(a->go, __ATOMIC_ACQUIRE)) cpu_relax();
    uint64_t s = 0;
    for (int r = 0; r < a->reps; r++)
        for (size_t i = 0; i < a->words; i++) s += a->buf[i];
    a->sum = s;
    return 0;
}

/* Bytes per second of n threads each reading its share of buf `reps` times; < 0 on error. */
double aq_probe_bandwidth(const void *buf, size_t bytes, int n, const int *cpus, int reps) {
    if (n < 1 || n > MAXT) return -1;
    pthread_t th[MAXT];
    probe_arg args[MAXT];
    int go = 0;
    size_t words = bytes / 8 / (size_t)n;
    int started = 0;
    for (int i = 0; i < n; i++) {
        args[i] = (probe_arg){(const uint64_t *)buf + words * i, words, cpus ? cpus[i] : -1, reps, &go, 0};
        if (pthread_create(&th[i], 0, probe_thread, &args[i])) break;
        started++;
    }
    long t0 = now_ns();
    __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < started; i++) pthread_join(th[i], 0);
    long t1 = now_ns();
    if (started < n) return -1;
    uint64_t sink = 0;
    for (int i = 0; i < n; i++) sink += args[i].sum;
    __atomic_store_n(&go, (int)(sink & 1), __ATOMIC_RELAXED);   /* keep the sums live */
    return (double)(words * 8 * (size_t)n * (size_t)reps) / ((double)(t1 - t0) * 1e-9);
}
