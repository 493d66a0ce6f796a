"""GPUs through NVML (nvidia-ml-py): utilisation, memory, clock throttle reasons.

A host without a GPU or driver is a reported state (collector success 0), not an error.
The nvml module is injectable so tests can stand in for hardware that is not here.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from turbonode.errors import TurbonodeError

from .base import Watcher

# nvmlClocksThrottleReason* bits (nvml.h); names for the labelled gauge.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


class GpuWatcher(Watcher):
    name = "gpu"
    interval = 1.0  # NVML queries take milliseconds each; GPU state is not a fast policy signal

    def __init__(self, nvml=None):
        super().__init__()
        self.init_error: str | None = None
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self.nvml = nvml
        except Exception as exc:  # NVMLError (library or driver missing), ImportError
            self.nvml = None
            self.init_error = f"NVML unavailable: {exc}"

    def read(self, now):
        if self.nvml is None:
            raise TurbonodeError(self.init_error)
        nv = self.nvml
        # NVML 12.x renamed "throttle" reasons to "clocks event" reasons; older drivers have only the first.
        reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        try:
            gpus = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                gpus.append(
                    {
                        "index": i,
                        "utilization": util.gpu / 100.0,
                        "memory_used_bytes": mem.used,
                        "memory_total_bytes": mem.total,
                        "throttle_reasons": reasons(h),
                    }
                )
        except nv.NVMLError as exc:
            raise TurbonodeError(f"NVML query failed: {exc}") from None
        signals = {"gpu_utilization": max((g["utilization"] for g in gpus), default=None)}
        return signals, {"gpus": gpus}

    def families(self):
        gpus = self.detail.get("gpus", []) if self.ok else []
        util = GaugeMetricFamily("turbonode_gpu_utilization_ratio", "GPU busy share (NVML)", labels=["gpu"])
        used = GaugeMetricFamily("turbonode_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"])
        total = GaugeMetricFamily("turbonode_gpu_memory_total_bytes", "GPU memory size (NVML)", labels=["gpu"])
        thr = GaugeMetricFamily(
            "turbonode_gpu_clocks_throttled",
            "1 while NVML reports this clock throttle reason",
            labels=["gpu", "reason"],
        )
        for g in gpus:
            idx = str(g["index"])
            util.add_metric([idx], g["utilization"])
            used.add_metric([idx], g["memory_used_bytes"])
            total.add_metric([idx], g["memory_total_bytes"])
            for bit, reason in THROTTLE_REASONS.items():
                thr.add_metric([idx, reason], 1.0 if g["throttle_reasons"] & bit else 0.0)
        return [util, used, total, thr]

    def close(self):
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass
            self.nvml = None
