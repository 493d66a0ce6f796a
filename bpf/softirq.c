// Softirq accounting from the irq:softirq_raise/entry/exit tracepoints.
//
// Per CPU and vector: nanoseconds spent in the handler and the number of runs; per vector:
// a log2 histogram of the raise-to-entry latency in nanoseconds. All counters are
// cumulative; the agent reads deltas. Per-CPU maps so the hot path never contends.
//
// Build-time constants come from agent/watchers/softirq.py via cflags, so the reader and the
// maps cannot disagree: NR_VEC (the kernel's softirq vectors, NR_SOFTIRQS: HI TIMER NET_TX
// NET_RX BLOCK IRQ_POLL TASKLET SCHED HRTIMER RCU) and NR_SLOTS (log2(ns) latency buckets,
// the last one open-ended).
#if !defined(NR_VEC) || !defined(NR_SLOTS)
#error "NR_VEC and NR_SLOTS are passed as cflags by agent/watchers/softirq.py"
#endif

BPF_PERCPU_ARRAY(raised_at, u64, NR_VEC);   // first raise not yet served, per CPU
BPF_PERCPU_ARRAY(entered_at, u64, NR_VEC);
BPF_PERCPU_ARRAY(time_ns, u64, NR_VEC);
BPF_PERCPU_ARRAY(runs, u64, NR_VEC);
BPF_PERCPU_ARRAY(latency, u64, NR_VEC * NR_SLOTS);

// Slot s counts latencies in [2^(s-1), 2^s) ns (bcc's bpf_log2l); the last slot is open-ended.
static __always_inline u32 log2_slot(u64 v)
{
    u32 slot = bpf_log2l(v);
    return slot < NR_SLOTS ? slot : NR_SLOTS - 1;
}

TRACEPOINT_PROBE(irq, softirq_raise)
{
    u32 vec = args->vec;
    if (vec >= NR_VEC)
        return 0;
    u64 *ts = raised_at.lookup(&vec);
    // Keep the oldest pending raise: latency is measured from the first one.
    if (ts && *ts == 0)
        *ts = bpf_ktime_get_ns();
    return 0;
}

TRACEPOINT_PROBE(irq, softirq_entry)
{
    u32 vec = args->vec;
    if (vec >= NR_VEC)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 *ts = entered_at.lookup(&vec);
    if (ts)
        *ts = now;
    u64 *raised = raised_at.lookup(&vec);
    if (raised && *raised) {
        u64 delta = now > *raised ? now - *raised : 0;
        *raised = 0;
        u32 idx = vec * NR_SLOTS + log2_slot(delta);
        u64 *cnt = latency.lookup(&idx);
        if (cnt)
            (*cnt)++;
    }
    return 0;
}

TRACEPOINT_PROBE(irq, softirq_exit)
{
    u32 vec = args->vec;
    if (vec >= NR_VEC)
        return 0;
    u64 *ts = entered_at.lookup(&vec);
    if (!ts || *ts == 0)
        return 0;   // entered before we attached
    u64 delta = bpf_ktime_get_ns() - *ts;
    *ts = 0;
    u64 *t = time_ns.lookup(&vec);
    if (t)
        *t += delta;
    u64 *n = runs.lookup(&vec);
    if (n)
        (*n)++;
    return 0;
}
