// Calibration for bench/qos_latency.py: a classifier that does nothing but pick the default
// class. Its run time on the same traffic is the cost of merely running a cls_bpf program
// (and of the kernel's run-time accounting) on this machine; the real classifier's own cost
// is the difference.
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>

int classify(struct __sk_buff *skb)
{
    skb->tc_classid = DEFAULT_MINOR;
    return TC_ACT_OK;
}
