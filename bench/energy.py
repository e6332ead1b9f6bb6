"""The GPU's energy counter, read through NVML (ctypes on the driver's libnvidia-ml; nothing to install).

At the H200's 700 W cap a step's time is its energy over 700 W, so what a kernel costs the step is the
energy it spends, which its time alone does not say (a memory-bound pass draws less than a product).
NVML's total-energy counter (millijoules since the driver loaded) gives that energy over an interval
without polling, which earlier runs found disturbs the steps (bench/RESULTS.md, run M).
"""
from __future__ import annotations

import ctypes

_NVML_CLOCK_SM = 1
_NVML_TEMPERATURE_GPU = 0
# nvmlPerfPolicyType_t: the policies whose violation time (ns the clock was held below what was asked) NVML keeps
_NVML_PERF_POLICIES = {"power": 0, "thermal": 1}
# nvmlClocksEventReasons bits: why the clock is where it is at the moment of the query
CLOCK_EVENT_REASONS = {0x1: "idle", 0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal",
                       0x40: "hw thermal", 0x80: "hw power brake"}


class _ViolationTime(ctypes.Structure):
    _fields_ = [("reference_time", ctypes.c_ulonglong), ("violation_time", ctypes.c_ulonglong)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class EnergyCounter:
    """The energy counter, SM clock, temperature and power limit of the NVML device behind a CUDA device."""

    def __init__(self, device_index: int = 0):
        import torch
        self._nvml = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self._nvml.nvmlInit_v2(), "nvmlInit")
        self._handle = ctypes.c_void_p()
        props = torch.cuda.get_device_properties(device_index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:  # by PCI address: CUDA's and NVML's device orders can differ
            address = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
            self._check(self._nvml.nvmlDeviceGetHandleByPciBusId_v2(address.encode(), ctypes.byref(self._handle)),
                        f"handle of {address}")
        else:
            self._check(self._nvml.nvmlDeviceGetHandleByIndex_v2(device_index, ctypes.byref(self._handle)),
                        f"handle of device {device_index}")

    @staticmethod
    def _check(rc: int, what: str):
        if rc != 0:
            raise RuntimeError(f"NVML: {what} failed (NVML error {rc})")

    def millijoules(self) -> int:
        """Energy the device has used since the driver loaded, mJ."""
        value = ctypes.c_ulonglong()
        self._check(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(value)), "energy")
        return int(value.value)

    def sm_clock_mhz(self) -> int:
        value = ctypes.c_uint()
        self._check(self._nvml.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(value)), "SM clock")
        return int(value.value)

    def temperature_c(self) -> int:
        """The GPU die's temperature, degrees C: at the power cap a hotter card leaks more and clocks lower,
        so the same kernels run slower (bench/RESULTS.md, runs Q-T)."""
        value = ctypes.c_uint()
        self._check(self._nvml.nvmlDeviceGetTemperature(self._handle, _NVML_TEMPERATURE_GPU, ctypes.byref(value)),
                    "temperature")
        return int(value.value)

    def throttled_ms(self) -> dict | None:
        """{"power": ms, "thermal": ms}: the time, since the driver loaded, the clock was held down by the power cap
        and by temperature (None where the driver does not keep these counters). Read around an interval, the
        differences say which of the two held a run's clock down, without polling."""
        query = getattr(self._nvml, "nvmlDeviceGetViolationStatus", None)
        out = {}
        for name, policy in _NVML_PERF_POLICIES.items():
            value = _ViolationTime()
            if query is None or query(self._handle, policy, ctypes.byref(value)) != 0:
                return None
            out[name] = value.violation_time * 1e-6
        return out

    def clock_event_reasons(self) -> int | None:
        """The bit mask of why the SM clock is where it is now (CLOCK_EVENT_REASONS), or None if unsupported."""
        value = ctypes.c_ulonglong()
        # drivers before 535 name it the throttle reasons
        query = (getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                 or getattr(self._nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        return int(value.value) if query is not None and query(self._handle, ctypes.byref(value)) == 0 else None

    def memory_used_bytes(self) -> int:
        """Device memory in use by every process (bench_step reads another program's, llm.c's, this way)."""
        value = _Memory()
        self._check(self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(value)), "memory info")
        return int(value.used)

    def power_limit_w(self) -> float:
        value = ctypes.c_uint()
        self._check(self._nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle, ctypes.byref(value)), "power limit")
        return value.value / 1000


def reason_names(mask: int) -> list[str]:
    """The names of the CLOCK_EVENT_REASONS bits set in mask (others as hex)."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENT_REASONS)
    return names + ([hex(rest)] if rest else [])


def sustained_energy(fn, sustain_ms: float, counter: EnergyCounter) -> dict:
    """fn() back to back for sustain_ms to reach the power cap, then as many calls again, measured:
    {"ms": mean ms a call, "mj": mean mJ a call, "watts": mean power, "mhz": the SM clock at the end}.
    The counter is read around a synchronised stretch of at least sustain_ms (use ~1 s: NVML updates it
    every few ms)."""
    import torch

    from bench.timing import calls_to_sustain
    n = calls_to_sustain(fn, sustain_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    e0 = counter.millijoules()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    e1 = counter.millijoules()
    ms = start.elapsed_time(end)
    return {"ms": ms / n, "mj": (e1 - e0) / n, "watts": (e1 - e0) / ms, "mhz": counter.sm_clock_mhz()}
