"""The QoS datapath per tier: classifier packets/bytes (eBPF) and HTB drops/backlog.

Reads through tc.datapath.Datapath.show(); the per-tier families are what the eBPF
classifier and the tree add over node_exporter.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from turbonode.tiers import TIER_NAMES

from .base import Rate, Watcher


class HtbWatcher(Watcher):
    name = "htb"
    # Three netlink dumps and the map reads cost milliseconds, and no rule reads these signals (status
    # and metrics do, scraped every 15 s or so): every 2 s it took 18 % of the agent's loop with 4
    # workers (py-spy, bench/detection.py --workers 4), dumping qdiscs and filters twice then.
    interval = 5.0

    def __init__(self, datapath):
        super().__init__()
        self.datapath = datapath
        self._rate = Rate()

    def read(self, now):
        shown = self.datapath.show()
        tiers = {t: shown["tiers"][t] for t in TIER_NAMES if t in shown["tiers"]}
        rates = self._rate.update(now, {t: row.get("drops") or 0 for t, row in tiers.items()}) or {}
        signals = {f"{t}_drops_per_s": rates.get(t) for t in tiers}
        signals["turbo_backlog_bytes"] = tiers.get("turbo", {}).get("backlog_bytes")
        applied = {k: shown.get(k) for k in ("dev", "netns", "rate_bps", "leaf_kind", "prog_id")}
        return signals, {"tiers": tiers, "applied": applied, "unparsed": shown["tiers"].get("unparsed")}

    def status_view(self) -> dict:
        return {"qos": self.detail.get("tiers", {}), "datapath": self.detail.get("applied")}

    def families(self):
        if not self.ok:
            return []
        tiers = self.detail["tiers"]
        specs = [
            (CounterMetricFamily, "turbonode_tier_packets", "Packets the eBPF classifier put in each tier", "packets"),
            (CounterMetricFamily, "turbonode_tier_bytes", "Bytes the eBPF classifier put in each tier", "bytes"),
            (CounterMetricFamily, "turbonode_tier_drops", "Packets the tier's HTB class dropped", "drops"),
            (
                GaugeMetricFamily,
                "turbonode_tier_backlog_bytes",
                "Bytes queued in the tier's HTB class",
                "backlog_bytes",
            ),
            (
                GaugeMetricFamily,
                "turbonode_tier_ceil_bytes_per_second",
                "The tier's HTB ceil in force (relax's limit class while the agent's lease on it is fresh)",
                "ceil_bps",
            ),
        ]
        out = []
        for cls, name, doc, key in specs:
            fam = cls(name, doc, labels=["tier"])
            for t, row in tiers.items():
                v = row.get(key)
                if v is not None:
                    fam.add_metric([t], v / 8 if key == "ceil_bps" else v)
            out.append(fam)
        return out
