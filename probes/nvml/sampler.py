"""``NvmlSampler``: every GPU on the node through NVML (``nvidia-ml-py``, imported as ``pynvml``).

One full :class:`~flexpipe.schemas.GpuSample` per GPU per call: memory (v2: total, reserved, used,
free), SM and memory utilisation, power, temperature, volatile uncorrected ECC errors, retired
pages, XIDs seen since the previous sample, NVLink state and throughput, PCIe throughput, MIG
mode and the processes holding memory. XID errors arrive through an NVML event set polled with a
zero timeout, so the agent's loop never blocks on NVML.

Every NVML call goes through :meth:`NvmlSampler._try`: a call the device does not support yields
``None`` for that field, never an exception out of the sampler. ``GPU is lost`` (or "reset
required") marks the sample unhealthy and queues one ``GPU_ISOLATED`` event; recovery queues
``GPU_RESTORED``. The module is a parameter (STYLE §8): tests pass a fake with the real names.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flexpipe.errors import FlexPipeError
from flexpipe.schemas import (
    ClusterEvent,
    ClusterEventType,
    GpuProcess,
    GpuSample,
    SampleReason,
)
from probes.nvml.resolver import GpuResolver, default_resolver

log = logging.getLogger(__name__)

T = TypeVar("T")

KIB = 1024
_UINT_MAX = 0xFFFFFFFF  # NVML field scope meaning "summed over all links"
_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE


class NvmlUnavailable(FlexPipeError):
    """NVML could not be loaded or initialised; the message says why."""


@dataclass(slots=True)
class _Device:
    """What the sampler remembers about one GPU between samples."""

    index: int
    handle: Any
    uuid: str
    name: str
    lost: bool = False  # a call in the current round said "GPU is lost"
    was_lost: bool = False  # the previous round's verdict, for isolate/restore transitions
    nvlink_links: tuple[int, ...] | None = None  # link indices NVML answers for (found once)
    nvlink_prev: tuple[float, int, int] | None = None  # (now_s, tx KiB, rx KiB) of the last read
    memory_total_bytes: int = 0
    gpu_class: str | None = None  # last resolved, kept for samples of a lost GPU
    domain: str | None = None
    xids: list[int] = field(default_factory=list)  # XIDs since the previous sample
    processes: tuple[GpuProcess, ...] = ()


class NvmlSampler:
    """Reads every GPU on the node (``probes.base.GpuSampler``, name ``"nvml"``)."""

    name = "nvml"

    def __init__(
        self,
        node: str,
        nvml: Any | None = None,
        resolver: GpuResolver = default_resolver,
        max_events_per_poll: int = 64,
    ) -> None:
        """Initialise NVML, open every device and register for XID events.

        ``nvml`` is a ``pynvml``-like module (default: ``import pynvml``). Raises
        :class:`NvmlUnavailable` when NVML cannot be initialised or counted.
        """
        self._node = node
        self._resolver = resolver
        self._max_events = max_events_per_poll
        try:
            self._nvml = nvml if nvml is not None else importlib.import_module("pynvml")
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
        except Exception as exc:  # ImportError, NVMLError (driver not loaded, no library ...)
            raise NvmlUnavailable(f"NVML unavailable: {type(exc).__name__}: {exc}") from exc
        # NOTE: unversioned calls raise NVMLLibraryMismatchError (not an NVMLError) when the
        # driver's NVML lacks them; that is "not supported" too.
        mismatch = getattr(self._nvml, "NVMLLibraryMismatchError", None)
        self._errors: tuple[type[BaseException], ...] = (
            (self._nvml.NVMLError, mismatch) if mismatch else (self._nvml.NVMLError,)
        )
        self._logged: set[tuple[str, str, int]] = set()
        self._pending: list[ClusterEvent] = []
        self._closed = False
        self._devices = [self._open_device(i) for i in range(count)]
        self._event_set = self._register_xid_events()

    # -- helpers ---------------------------------------------------------------------------------

    def _try(
        self, dev: _Device | None, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T | None:
        """``fn(*args, **kwargs)``, or None when NVML refuses; "GPU is lost" marks ``dev`` lost."""
        # NOTE: inlined rather than delegating to _call: ~30 NVML calls per GPU per second go
        # through here, and a second Python frame per call was a tenth of the sampler's CPU.
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            self._refused(dev, fn, exc)
            return None

    def _call(
        self, dev: _Device | None, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> tuple[bool, T | None]:
        """Like :meth:`_try` but also says whether the call succeeded (for calls returning None)."""
        try:
            return True, fn(*args, **kwargs)
        except self._errors as exc:
            self._refused(dev, fn, exc)
            return False, None

    def _refused(self, dev: _Device | None, fn: Callable[..., Any], exc: BaseException) -> None:
        code = int(getattr(exc, "value", -1))
        if dev is not None and code in self._lost_codes():
            dev.lost = True
        self._log_once(dev, fn, code, exc)

    def _lost_codes(self) -> tuple[int, int]:
        nv = self._nvml
        return (
            getattr(nv, "NVML_ERROR_GPU_IS_LOST", 15),
            getattr(nv, "NVML_ERROR_RESET_REQUIRED", 16),
        )

    def _log_once(self, dev: _Device | None, fn: Callable[..., Any], code: int, exc: Any) -> None:
        where = dev.uuid if dev else "-"
        key = (where, getattr(fn, "__name__", repr(fn)), code)
        if key in self._logged:
            return
        self._logged.add(key)
        # "Not supported" and "invalid argument" (probing NVLink link indices) are facts about
        # the device, not trouble: debug. Anything else once as a warning.
        quiet = code in (
            getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
            getattr(self._nvml, "NVML_ERROR_INVALID_ARGUMENT", 2),
            getattr(self._nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
        )
        level = logging.DEBUG if quiet else logging.WARNING
        log.log(level, "nvml: %s on %s: %s", key[1], where, exc)

    def _open_device(self, index: int) -> _Device:
        dev = _Device(index, None, f"GPU-unknown-{self._node}-{index}", "unknown")
        self._reopen(dev)
        return dev

    def _reopen(self, dev: _Device) -> None:
        """Get a handle and identity; a GPU lost at start keeps a placeholder uuid until then."""
        nv = self._nvml
        handle = self._try(dev, nv.nvmlDeviceGetHandleByIndex, dev.index)
        if handle is None:
            return
        dev.handle = handle
        dev.uuid = self._try(dev, nv.nvmlDeviceGetUUID, handle) or dev.uuid
        dev.name = self._try(dev, nv.nvmlDeviceGetName, handle) or dev.name

    # -- sampling ----------------------------------------------------------------------------

    def sample(self, now_s: float) -> list[GpuSample]:
        """Full state of every GPU at ``now_s``; unsupported fields are None, never an exception."""
        if self._closed:
            return []
        samples = [self._sample_device(dev, now_s) for dev in self._devices]
        for dev in self._devices:
            self._note_health_transition(dev)
        return samples

    def _sample_device(self, dev: _Device, now_s: float) -> GpuSample:
        if dev.handle is None:
            self._reopen(dev)
        nv, h = self._nvml, dev.handle
        dev.lost = h is None
        mem = None
        if not dev.lost:
            mem = self._try(dev, nv.nvmlDeviceGetMemoryInfo, h, version=nv.nvmlMemory_v2)
        if mem is None and not dev.lost:  # drivers before the v2 struct: no reserved figure
            mem = self._try(dev, nv.nvmlDeviceGetMemoryInfo, h)
        if dev.lost or mem is None:
            return self._unhealthy_sample(dev)
        fields = self._optional_fields(dev, now_s)
        if dev.lost:  # lost half-way through: nothing read this round can be trusted
            return self._unhealthy_sample(dev)
        dev.memory_total_bytes = int(mem.total)
        dev.gpu_class, dev.domain = fields["gpu_class"], fields["domain"]
        xids, dev.xids = tuple(dev.xids), []
        return GpuSample(
            gpu_uuid=dev.uuid,
            node=self._node,
            name=dev.name,
            reason=SampleReason.DELTA,
            memory_total_bytes=int(mem.total),
            memory_used_bytes=int(mem.used),
            memory_free_bytes=int(mem.free),
            healthy=True,
            index=dev.index,
            memory_reserved_bytes=_int_or_none(getattr(mem, "reserved", None)),
            xid_errors=xids,
            **fields,
        )

    def _optional_fields(self, dev: _Device, now_s: float) -> dict[str, Any]:
        """GpuSample's optional fields (keyword arguments), each None when NVML cannot say."""
        nv, h = self._nvml, dev.handle
        util = self._try(dev, nv.nvmlDeviceGetUtilizationRates, h)
        power_mw = self._try(dev, nv.nvmlDeviceGetPowerUsage, h)
        links = self._nvlink_active(dev)
        tx, rx = self._nvlink_rates(dev, now_s) if links else (None, None)
        gpu_class, domain = self._resolver(self._node, dev.name, links)
        dev.processes = self._processes(dev)
        ecc = self._try(
            dev,
            nv.nvmlDeviceGetTotalEccErrors,
            h,
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nv.NVML_VOLATILE_ECC,
        )
        return {
            "gpu_class": gpu_class,
            "domain": domain,
            "sm_util_pct": float(util.gpu) if util is not None else None,
            "mem_util_pct": float(util.memory) if util is not None else None,
            "power_w": power_mw / 1000.0 if power_mw is not None else None,
            "temperature_c": self._temperature(dev),
            "ecc_uncorrected": _int_or_none(ecc),
            "retired_pages": self._retired_pages(dev),
            "nvlink_active_links": links,
            "nvlink_tx_bytes_per_s": tx,
            "nvlink_rx_bytes_per_s": rx,
            "pcie_tx_bytes_per_s": self._pcie(dev, nv.NVML_PCIE_UTIL_TX_BYTES),
            "pcie_rx_bytes_per_s": self._pcie(dev, nv.NVML_PCIE_UTIL_RX_BYTES),
            "mig_mode": self._mig_mode(dev),
            "processes": dev.processes,
        }

    def _unhealthy_sample(self, dev: _Device) -> GpuSample:
        """A lost GPU: unhealthy, no free memory (so nothing schedules onto it), no readings.

        Identity, class and domain are the last known ones, so consumers know which block lost it.
        """
        dev.lost = True
        dev.processes = ()
        xids, dev.xids = tuple(dev.xids), []
        total = dev.memory_total_bytes
        return GpuSample(
            gpu_uuid=dev.uuid,
            node=self._node,
            name=dev.name,
            reason=SampleReason.DELTA,
            memory_total_bytes=total,
            memory_used_bytes=total,
            memory_free_bytes=0,
            healthy=False,
            gpu_class=dev.gpu_class,
            domain=dev.domain,
            index=dev.index,
            xid_errors=xids,
        )

    def _note_health_transition(self, dev: _Device) -> None:
        if dev.lost == dev.was_lost:
            return
        dev.was_lost = dev.lost
        kind = ClusterEventType.GPU_ISOLATED if dev.lost else ClusterEventType.GPU_RESTORED
        detail = "NVML: GPU is lost" if dev.lost else "NVML: GPU answers again"
        self._pending.append(ClusterEvent(kind, self._node, (dev.uuid,), detail=detail))

    def _temperature(self, dev: _Device) -> float | None:
        nv = self._nvml
        temp = None
        if hasattr(nv, "nvmlDeviceGetTemperatureV"):
            temp = self._try(dev, nv.nvmlDeviceGetTemperatureV, dev.handle, nv.NVML_TEMPERATURE_GPU)
        if temp is None:  # older drivers only have the deprecated call
            temp = self._try(dev, nv.nvmlDeviceGetTemperature, dev.handle, nv.NVML_TEMPERATURE_GPU)
        return float(temp) if temp is not None else None

    def _retired_pages(self, dev: _Device) -> int | None:
        """Pages retired for either cause; None without page retirement (H100 remaps rows)."""
        nv = self._nvml
        causes = (
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        counts = [self._try(dev, nv.nvmlDeviceGetRetiredPages, dev.handle, c) for c in causes]
        known = [len(c) for c in counts if c is not None]
        return sum(known) if known else None

    def _nvlink_active(self, dev: _Device) -> int | None:
        """Active links, or None without NVLink. Which link indices answer is learnt once."""
        nv = self._nvml
        if dev.nvlink_links is None:
            answered: list[int] = []
            for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
                if self._try(dev, nv.nvmlDeviceGetNvLinkState, dev.handle, link) is not None:
                    answered.append(link)
            if dev.lost:
                return None  # learn the links from a healthy GPU, not a dying one
            dev.nvlink_links = tuple(answered)
        if not dev.nvlink_links:
            return None
        get_state, handle = nv.nvmlDeviceGetNvLinkState, dev.handle
        try:
            # NOTE: one guard for the whole round, not one _try per link: up to 18 links per GPU
            # every second; when a link refuses, the round is read again link by link below.
            states: list[int | None] = [get_state(handle, i) for i in dev.nvlink_links]
        except self._errors:
            states = [self._try(dev, get_state, handle, i) for i in dev.nvlink_links]
        known = [s for s in states if s is not None]
        return sum(1 for s in known if s == nv.NVML_FEATURE_ENABLED) if known else None

    def _nvlink_rates(self, dev: _Device, now_s: float) -> tuple[float | None, float | None]:
        """Bytes/s from NVML's cumulative KiB counters (summed over links); None on first read."""
        nv = self._nvml
        fields = [
            (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _UINT_MAX),
            (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _UINT_MAX),
        ]
        values = self._try(dev, nv.nvmlDeviceGetFieldValues, dev.handle, fields)
        if values is None:
            return None, None
        tx_kib, rx_kib = (_field_value(nv, values[i]) for i in (0, 1))
        if tx_kib is None or rx_kib is None:
            dev.nvlink_prev = None
            return None, None
        prev, dev.nvlink_prev = dev.nvlink_prev, (now_s, tx_kib, rx_kib)
        if prev is None or now_s <= prev[0] or tx_kib < prev[1] or rx_kib < prev[2]:
            return None, None  # first read, or the counters were reset
        dt_s = now_s - prev[0]
        return (tx_kib - prev[1]) * KIB / dt_s, (rx_kib - prev[2]) * KIB / dt_s

    def _pcie(self, dev: _Device, counter: int) -> float | None:
        # NOTE: NVML reports PCIe throughput in KB/s over a 20 ms window; NVML's KB are KiB.
        kb_s = self._try(dev, self._nvml.nvmlDeviceGetPcieThroughput, dev.handle, counter)
        return float(kb_s) * KIB if kb_s is not None else None

    def _mig_mode(self, dev: _Device) -> bool | None:
        modes = self._try(dev, self._nvml.nvmlDeviceGetMigMode, dev.handle)
        return bool(modes[0] == _MIG_ENABLED) if modes is not None else None

    def _processes(self, dev: _Device) -> tuple[GpuProcess, ...]:
        """Compute and graphics processes, one entry per pid (the larger memory figure)."""
        nv = self._nvml
        used: dict[int, int | None] = {}
        for getter in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            procs = self._try(dev, getattr(nv, getter), dev.handle)
            if procs is None and hasattr(nv, getter + "_v2"):  # library older than the v3 call
                procs = self._try(dev, getattr(nv, getter + "_v2"), dev.handle)
            for p in procs or ():
                mem = _int_or_none(p.usedGpuMemory)
                prev = used.get(int(p.pid))
                used[int(p.pid)] = mem if prev is None else max(prev, mem or 0)
        return tuple(GpuProcess(pid, used[pid]) for pid in sorted(used))

    # -- events ------------------------------------------------------------------------------

    def _register_xid_events(self) -> Any | None:
        nv = self._nvml
        event_set = self._try(None, nv.nvmlEventSetCreate)
        if event_set is None:
            return None
        xid = nv.nvmlEventTypeXidCriticalError
        registered = 0
        for dev in self._devices:
            if dev.handle is None:
                continue
            supported = self._try(dev, nv.nvmlDeviceGetSupportedEventTypes, dev.handle)
            if supported is not None and not supported & xid:
                continue
            ok, _ = self._call(dev, nv.nvmlDeviceRegisterEvents, dev.handle, xid, event_set)
            registered += ok
        if registered == 0:
            self._try(None, nv.nvmlEventSetFree, event_set)
            return None
        return event_set

    def poll_events(self, now_s: float) -> list[ClusterEvent]:
        """GPU isolation/restoration seen by :meth:`sample`, then XIDs waiting in the event set.

        Never blocks: the event set is read with a zero timeout, at most ``max_events_per_poll``.
        """
        events, self._pending = self._pending, []
        if self._event_set is None or self._closed:
            return events
        nv = self._nvml
        for _ in range(self._max_events):
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, 0)
            except self._errors as exc:
                if int(getattr(exc, "value", -1)) != nv.NVML_ERROR_TIMEOUT:
                    self._log_once(
                        None, nv.nvmlEventSetWait_v2, int(getattr(exc, "value", -1)), exc
                    )
                break  # timeout: nothing (more) waiting
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                events.append(self._xid_event(data))
        return events

    def _xid_event(self, data: Any) -> ClusterEvent:
        xid = int(data.eventData)
        dev = next((d for d in self._devices if _same_handle(d.handle, data.device)), None)
        uuid = dev.uuid if dev else self._try(None, self._nvml.nvmlDeviceGetUUID, data.device)
        if dev is not None:
            dev.xids.append(xid)
        detail = f"XID {xid}"
        gi = int(getattr(data, "gpuInstanceId", _UINT_MAX))
        ci = int(getattr(data, "computeInstanceId", _UINT_MAX))
        if gi != _UINT_MAX:
            detail += f" (MIG GPU instance {gi}, compute instance {ci})"
        return ClusterEvent(
            ClusterEventType.XID, self._node, (uuid,) if uuid else (), xid=xid, detail=detail
        )

    # -- the rest ----------------------------------------------------------------------------

    @property
    def gpu_count(self) -> int:
        """Devices NVML reported at start (lost ones included)."""
        return len(self._devices)

    def gpus_of_pid(self) -> dict[int, tuple[str, ...]]:
        """pid -> uuids of the GPUs whose process list held it at the last sample (for eBPF)."""
        out: dict[int, list[str]] = {}
        for dev in self._devices:
            for proc in dev.processes:
                out.setdefault(proc.pid, []).append(dev.uuid)
        return {pid: tuple(uuids) for pid, uuids in out.items()}

    def close(self) -> None:
        """Free the event set and shut NVML down; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._event_set is not None:
            self._try(None, self._nvml.nvmlEventSetFree, self._event_set)
            self._event_set = None
        self._try(None, self._nvml.nvmlShutdown)


def _field_value(nv: Any, fv: Any) -> int | None:
    """One nvmlFieldValue_t as an int, or None when NVML returned an error for that field."""
    if int(fv.nvmlReturn) != 0:
        return None
    by_type = {
        nv.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nv.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    }
    attr = by_type.get(int(fv.valueType))
    return int(getattr(fv.value, attr)) if attr else None


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None


def _same_handle(a: Any, b: Any) -> bool:
    """Handle equality: pynvml's handles are ctypes pointers, equal when they point alike."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    try:
        return bool(ctypes.addressof(a.contents) == ctypes.addressof(b.contents))
    except (AttributeError, TypeError, ValueError):
        return False


def open_nvml_sampler(node: str, **kwargs: Any) -> tuple[NvmlSampler | None, str]:
    """The sampler, or ``(None, why)`` when NVML is unavailable (no driver, no GPU)."""
    try:
        sampler = NvmlSampler(node, **kwargs)
    except NvmlUnavailable as exc:
        return None, str(exc)
    return sampler, f"NVML with {sampler.gpu_count} GPU(s)"
