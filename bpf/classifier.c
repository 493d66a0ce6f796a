// turbonode egress classifier: cls_bpf direct-action under the HTB root 1:.
//
// Reads the DSCP of IPv4/IPv6 frames (optionally behind one 802.1Q/802.1ad tag), looks the
// tier up in dscp_map and steers the frame to that tier's HTB class by writing the class
// minor into skb->tc_classid (the filter carries the major 1:, see docs/design.md). Anything it
// cannot parse goes to the default tier. It never drops: every path returns TC_ACT_OK.
//
// A lowered ceiling is a lease: it lives in the tier's limit class (tier_limit), and frames go
// there only while the lease's deadline, on bpf_ktime_get_ns()'s clock, lies ahead. The agent
// moves the deadline on at every renewal; when nobody does (agent killed, hung, never
// restarted), the tier is back in its own class at its full ceiling by itself.
//
// Build-time constants come from turbonode/tiers.py via cflags: PIN_DIR (bpffs directory of
// the pinned maps), NTIERS, DEFAULT_TIER, DEFAULT_MINOR. Runtime knobs are maps.
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>

#define ETH_HLEN_ 14
#define VLAN_HLEN_ 4
// Counter slot NTIERS counts frames that fell back to the default tier because they could
// not be parsed (they are also counted in the default tier's slot).
#define UNPARSED NTIERS

struct tier_count {
    u64 packets;
    u64 bytes;
};

// DSCP (0..63) -> tier index. Written by user space; unset entries (0) would mean tier 0,
// so user space always writes all 64.
BPF_TABLE_PINNED("array", u32, u32, dscp_map, 64, PIN_DIR "/dscp_map");
// tier index -> HTB class minor (0x10 for 1:10 ...). A zero minor falls back to the default.
BPF_TABLE_PINNED("array", u32, u32, tier_minor, NTIERS, PIN_DIR "/tier_minor");
BPF_TABLE_PINNED("percpu_array", u32, struct tier_count, counters, NTIERS + 1, PIN_DIR "/counters");

struct tier_limit {
    u64 until_ns;  // lease deadline (bpf_ktime_get_ns()); 0 or past: no limit in force
    u32 minor;     // the tier's limit class (0x41 for 1:41); 0: the tier has none
    u32 pad;
};
// tier index -> its leased limit. Written by user space: the minors at apply, the deadline by
// the agent.
BPF_TABLE_PINNED("array", u32, struct tier_limit, tier_limit, NTIERS, PIN_DIR "/tier_limit");

static __always_inline void count(u32 slot, u32 len)
{
    struct tier_count *c = counters.lookup(&slot);
    if (c) {
        c->packets++;
        c->bytes += len;
    }
}

// Returns the DSCP, or -1 when the frame is not a complete IPv4/IPv6 header.
static __always_inline int parse_dscp(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    u32 off = ETH_HLEN_;

    if (data + ETH_HLEN_ + VLAN_HLEN_ > data_end)
        return -1;  // too short for anything we classify (an IPv4 header is longer)
    u16 proto = *(u16 *)(data + 12);
    if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD)) {
        proto = *(u16 *)(data + 16);
        off += VLAN_HLEN_;
    }
    if (proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = data + off;
        if ((void *)(ip + 1) > data_end)
            return -1;
        if (ip->version != 4 || ip->ihl < 5)
            return -1;
        return ip->tos >> 2;
    }
    if (proto == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr *ip6 = data + off;
        if ((void *)(ip6 + 1) > data_end)
            return -1;
        if (ip6->version != 6)
            return -1;
        // Traffic class spans the low nibble of byte 0 and the high nibble of byte 1;
        // DSCP is its top six bits (ECN, the low two, is ignored).
        u8 *b = (u8 *)ip6;
        u8 tclass = ((b[0] & 0x0f) << 4) | (b[1] >> 4);
        return tclass >> 2;
    }
    return -1;
}

int classify(struct __sk_buff *skb)
{
    int dscp = parse_dscp(skb);
    // Headers outside the linear area (rare on egress) are pulled in once and parsed again.
    if (dscp < 0 && skb->data_end - skb->data < skb->len) {
        u32 want = ETH_HLEN_ + VLAN_HLEN_ + sizeof(struct ipv6hdr);
        if (bpf_skb_pull_data(skb, skb->len < want ? skb->len : want) == 0)
            dscp = parse_dscp(skb);
    }

    u32 tier = DEFAULT_TIER;
    if (dscp >= 0) {
        u32 key = dscp;
        u32 *t = dscp_map.lookup(&key);
        if (t && *t < NTIERS)
            tier = *t;
    } else {
        count(UNPARSED, skb->len);
    }

    u32 minor = DEFAULT_MINOR;
    u32 *m = tier_minor.lookup(&tier);
    if (m && *m && *m <= 0xffff)
        minor = *m;
    else
        tier = DEFAULT_TIER;
    struct tier_limit *l = tier_limit.lookup(&tier);
    if (l && l->until_ns && l->minor && l->minor <= 0xffff && bpf_ktime_get_ns() < l->until_ns)
        minor = l->minor;
    count(tier, skb->len);
    // Only the minor: the kernel ORs in the filter's major (1:). A zero minor would make HTB
    // treat the frame as "direct" and bypass shaping, hence the default above.
    skb->tc_classid = minor;
    return TC_ACT_OK;
}
