"""A worker's GPUs through NVML (nvidia-ml-py): utilisation, memory, clock throttle reasons.

One watcher per worker, for the GPU it renders on: the one whose UUID the worker reports in its
status (its backend's `gpu_uuid`: under Kubernetes' device plugin a container sees its GPU as
cuda:0 whatever NVML's index), else the index its `[workers.<name>] gpu` names, else (a node
that names no workers) every GPU NVML sees. A host without a GPU or driver, or a GPU it does not
have, is a reported state (collector success 0), not an error. The nvml module is injectable so
tests can stand in for hardware that is not here.
"""

from __future__ import annotations

from collections.abc import Callable

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
    signal_names = ("gpu_utilization",)  # about its worker's GPU: per-worker rules (agent/worker_unit.py)
    interval = 1.0  # NVML queries take milliseconds each; GPU state is not a fast policy signal

    def __init__(
        self,
        nvml=None,
        indexes: tuple[int, ...] | None = None,
        uuid: Callable[[], str | None] = lambda: None,
    ):
        super().__init__()
        self.indexes = indexes  # NVML indexes to read; None: all
        self.uuid = uuid  # the GPU its worker says it renders on, once it has said so
        self.init_error: str | None = None
        try:
            if nvml is None:
                import pynvml

                nvml = pynvml
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
        uuid = self.uuid()
        try:
            if uuid is not None:
                handles = [nv.nvmlDeviceGetHandleByUUID(uuid)]
                which = [nv.nvmlDeviceGetIndex(handles[0])]
            else:
                if self.indexes == ():
                    raise TurbonodeError("no GPU known for this worker yet (it has not named one)")
                which = list(range(nv.nvmlDeviceGetCount()) if self.indexes is None else self.indexes)
                handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in which]
            gpus = []
            for i, h in zip(which, handles):
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
            gpu = uuid or (None if self.indexes is None else ", ".join(map(str, self.indexes)))
            raise TurbonodeError(f"NVML query{f' of GPU {gpu}' if gpu else ''} failed: {exc}") from None
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
