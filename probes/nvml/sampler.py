"""``NvmlSampler``: every GPU on the node through NVML (``nvidia-ml-py``, imported as ``pynvml``).

One full :class:`~flexpipe.schemas.GpuSample` per GPU per call: memory (v2: total, reserved, used,
free), SM and memory utilisation, power, temperature, volatile uncorrected ECC errors, retired
pages, XIDs seen since the previous sample, NVLink state and throughput, PCIe throughput, MIG
mode and the processes holding memory. XID errors arrive through an NVML event set polled with a
zero timeout, so the agent's loop never blocks on NVML.

Per GPU per sample: seven NVML calls, one of them ``nvmlDeviceGetFieldValues`` carrying ECC,
retired pages and the NVLink counters (a prebuilt field array handed to NVML's C function, when
pynvml exposes it). NVLink link states ride in that call too, but only every
``link_state_period_s`` (10 s by default), at the sample after an XID of that GPU (a failing link
raises XID 74), after the GPU comes back, and again while a read failed; in between a sample
carries the last count. Drivers without the link-state field are read link by link, as rarely.
MIG mode (which changes on a GPU reset) is read on the same schedule. The two process lists
(compute, graphics) are read when the GPU's used memory moved since their last read (a process
holds device memory from its CUDA context on, so one starting or exiting moves it), every
``process_period_s`` (10 s) otherwise, and after an XID or the GPU coming back.

Every NVML call goes through :meth:`NvmlSampler._try`: a call the device does not support yields
``None`` for that field, never an exception out of the sampler. ``GPU is lost`` (or "reset
required") marks the sample unhealthy and queues one ``GPU_ISOLATED`` event; recovery queues
``GPU_RESTORED``. The module is a parameter (STYLE §8): tests pass a fake with the real names.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import struct
import sys
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
    gpu_sample,
)
from probes.nvml.resolver import GpuResolver, default_resolver

log = logging.getLogger(__name__)

T = TypeVar("T")

KIB = 1024
_UINT_MAX = 0xFFFFFFFF  # NVML field scope meaning "summed over all links"
_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE
# Link states change on a link failure (which raises an XID: read at the next sample) or a fabric
# reconfiguration; 18 links per GPU every second were most of the sampler's NVML work.
DEFAULT_LINK_STATE_PERIOD_S = 10.0
# After a refused call a GPU is read call by call (each refusal a null field) for this long, then
# the one-guard read is tried again: "not supported" is a fact about the device, so it stays.
_GUARDED_FOR_S = 60.0
_FAST_CALLS = (
    "nvmlMemory_v2",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
)
# How old a GPU's process lists may get while its used memory stays put (see _read_processes).
DEFAULT_PROCESS_PERIOD_S = 10.0
# (memory struct, utilisation struct or None, power mW, °C, PCIe tx, rx B/s): decoded in one place
_Reads = tuple[Any, Any | None, int | None, float | None, float | None, float | None]


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
    # The nvmlDeviceGetFieldValues request of every sample, without and with the link states
    # (built once the links are known): field ids, or (count, byref(array), array) for the C call
    requests: dict[bool, Any] = field(default_factory=dict)
    states_by_field: bool = True  # False: the driver lacks NVML_FI_DEV_NVLINK_GET_STATE
    nvlink_active: int | None = None  # active links at the last state read
    states_read_s: float | None = None  # when the link states were last read (None: due now)
    mig_mode: bool | None = None  # at the last read
    mig_read_s: float | None = None  # when MIG mode was last read (None: due now)
    nvlink_prev: tuple[float, int, int] | None = None  # (now_s, tx KiB, rx KiB) of the last read
    memory_total_bytes: int = 0
    gpu_class: str | None = None  # last resolved, kept for samples of a lost GPU
    domain: str | None = None
    xids: list[int] = field(default_factory=list)  # XIDs since the previous sample
    processes: tuple[GpuProcess, ...] = ()
    processes_read_s: float | None = None  # when the process lists were last read (None: due)
    processes_used_bytes: int | None = None  # the GPU's used memory at that read
    guarded_until_s: float = float("-inf")  # read call by call until then (after a refusal)


class NvmlSampler:
    """Reads every GPU on the node (``probes.base.GpuSampler``, name ``"nvml"``)."""

    name = "nvml"

    def __init__(
        self,
        node: str,
        nvml: Any | None = None,
        resolver: GpuResolver = default_resolver,
        max_events_per_poll: int = 64,
        link_state_period_s: float = DEFAULT_LINK_STATE_PERIOD_S,
        process_period_s: float = DEFAULT_PROCESS_PERIOD_S,
    ) -> None:
        """Initialise NVML, open every device and register for XID events.

        ``nvml`` is a ``pynvml``-like module (default: ``import pynvml``). Raises
        :class:`NvmlUnavailable` when NVML cannot be initialised or counted.
        ``link_state_period_s``: how old a GPU's NVLink link states and MIG mode may get (0:
        every sample); an XID of that GPU makes them due at its next sample.
        ``process_period_s``: how old a GPU's process lists may get while its used memory does
        not move (0: every sample); a move, an XID or a GPU coming back makes them due.
        """
        self._node = node
        self._link_state_period_s = link_state_period_s
        self._process_period_s = process_period_s
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
        self._c_field_values = self._c_function("nvmlDeviceGetFieldValues")
        nv = self._nvml
        self._get_temperature: Callable[..., Any] = getattr(
            nv, "nvmlDeviceGetTemperatureV", nv.nvmlDeviceGetTemperature
        )
        # a pynvml without one of the calls :meth:`_read_fast` makes is read call by call
        self._fast = all(hasattr(nv, name) for name in _FAST_CALLS)
        self._pending: list[ClusterEvent] = []
        self._closed = False
        self._devices = [self._open_device(i) for i in range(count)]
        self._event_set = self._register_xid_events()

    # -- helpers ---------------------------------------------------------------------------------

    def _c_function(self, name: str) -> Callable[..., int] | None:
        """NVML's C function itself (``pynvml._nvmlGetFunctionPointer``), or None.

        pynvml's ``nvmlDeviceGetFieldValues`` builds a new ``nvmlFieldValue_t`` array on every
        call, two Python attribute writes per field; the sampler asks for the same ~20 fields
        every second, so it builds each GPU's array once and hands it to the C function.
        """
        get = getattr(self._nvml, "_nvmlGetFunctionPointer", None)
        if get is None or not hasattr(self._nvml, "c_nvmlFieldValue_t"):
            return None
        try:
            return get(name)
        except self._errors:
            return None

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

    def _refused(
        self, dev: _Device | None, fn: Callable[..., Any] | str, exc: BaseException
    ) -> None:
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

    def _log_once(
        self, dev: _Device | None, fn: Callable[..., Any] | str, code: int, exc: Any
    ) -> None:
        where = dev.uuid if dev else "-"
        name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
        key = (where, name, code)
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
        reads = None
        fast = self._fast and dev.handle is not None and now_s >= dev.guarded_until_s
        if fast:
            try:
                reads = self._read_fast(dev.handle)
            except self._errors:  # read again call by call below, and so for a while
                dev.guarded_until_s = now_s + _GUARDED_FOR_S
                fast = False
            else:
                dev.lost = False
        if reads is None:
            reads = self._read_guarded(dev)
            if reads is None:
                return self._unhealthy_sample(dev)
        mem, util, power_mw, temp, pcie_tx, pcie_rx = reads
        total, reserved, free, used = _memory(mem)
        sm, mem_util = _utilization(util) if util is not None else (None, None)
        read_s = dev.processes_read_s
        if (
            read_s is None
            or used != dev.processes_used_bytes
            or not read_s <= now_s < read_s + self._process_period_s
        ):
            self._read_processes(dev, fast, used, now_s)
        known = self._nvlink_links(dev)
        ecc, retired, links, tx, rx = self._counters(dev, known or (), now_s)
        gpu_class, domain = self._resolver(self._node, dev.name, links)
        mig_mode = self._mig_mode(dev, now_s)
        if dev.lost:  # lost half-way through: nothing read this round can be trusted
            return self._unhealthy_sample(dev)
        dev.memory_total_bytes = total
        dev.gpu_class, dev.domain = gpu_class, domain
        xids, dev.xids = tuple(dev.xids), []
        # NOTE: one constructor call with every field, no intermediate dict, through gpu_sample
        # (the frozen dataclass's own __init__ costs ~4 µs of field writes): once per GPU per s.
        # Positional, in GpuSample's field order (26 keywords cost ~1.2 µs more to bind).
        return gpu_sample(
            dev.uuid,  # gpu_uuid
            self._node,  # node
            dev.name,  # name
            SampleReason.DELTA,  # reason
            total,  # memory_total_bytes
            used,  # memory_used_bytes
            free,  # memory_free_bytes
            True,  # healthy
            gpu_class,  # gpu_class
            domain,  # domain
            dev.index,  # index
            reserved,  # memory_reserved_bytes
            sm,  # sm_util_pct
            mem_util,  # mem_util_pct
            power_mw / 1000.0 if power_mw is not None else None,  # power_w
            temp,  # temperature_c
            ecc,  # ecc_uncorrected
            retired,  # retired_pages
            xids,  # xid_errors
            links,  # nvlink_active_links
            tx,  # nvlink_tx_bytes_per_s
            rx,  # nvlink_rx_bytes_per_s
            pcie_tx,  # pcie_tx_bytes_per_s
            pcie_rx,  # pcie_rx_bytes_per_s
            mig_mode,  # mig_mode
            dev.processes,  # processes
        )

    def _read_fast(self, h: Any) -> _Reads:
        """The per-sample NVML calls under one guard (the usual case: every call answers).

        NOTE: one Python frame and one ``try`` per GPU instead of one per call (~6 per GPU every
        second); any refusal raises and the sample is read again through :meth:`_read_guarded`,
        which nulls just the refused fields. Only reads happen here, so reading twice is safe.
        """
        nv = self._nvml
        return (
            nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2),
            nv.nvmlDeviceGetUtilizationRates(h),
            nv.nvmlDeviceGetPowerUsage(h),
            float(self._get_temperature(h, nv.NVML_TEMPERATURE_GPU)),
            float(nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)) * KIB,
            float(nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)) * KIB,
        )

    def _read_guarded(self, dev: _Device) -> _Reads | None:
        """The per-sample NVML calls one by one, a refused one a null field; None: GPU lost."""
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
            return None
        reads = (
            mem,
            self._try(dev, nv.nvmlDeviceGetUtilizationRates, h),
            self._try(dev, nv.nvmlDeviceGetPowerUsage, h),
            self._temperature(dev),
            self._pcie(dev, nv.NVML_PCIE_UTIL_TX_BYTES),
            self._pcie(dev, nv.NVML_PCIE_UTIL_RX_BYTES),
        )
        return None if dev.lost else reads

    def _read_processes(self, dev: _Device, fast: bool, used: int, now_s: float) -> None:
        """Read the GPU's process lists into ``dev.processes`` (kept when unchanged).

        Called when the lists are due: on the first sample, when the GPU's used memory moved
        since the last read, every ``process_period_s``, after an XID and after the GPU comes
        back. A process holds device memory from its CUDA context on, so one that starts or
        exits (or grows) moves ``used``; in between the last lists stand. ``fast``: both calls
        under one guard (a refusal reads them again call by call).
        """
        procs = None
        if fast:
            nv, h = self._nvml, dev.handle
            try:
                compute = nv.nvmlDeviceGetComputeRunningProcesses(h)
                graphics = nv.nvmlDeviceGetGraphicsRunningProcesses(h)
            except self._errors:
                pass
            else:
                procs = _merge_processes((compute, graphics)) if compute or graphics else ()
        if procs is None:
            procs = self._processes(dev)
        if procs != dev.processes:  # else keep the old tuple: the delta filter compares by identity
            dev.processes = procs
        if not dev.lost:
            dev.processes_read_s, dev.processes_used_bytes = now_s, used

    def _counters(
        self, dev: _Device, known: tuple[int, ...], now_s: float
    ) -> tuple[int | None, int | None, int | None, float | None, float | None]:
        """ECC, retired pages, active NVLinks and NVLink tx/rx bytes/s: one field-values call.

        The request: volatile uncorrected ECC errors, pages retired for either cause, then with
        NVLink the tx/rx KiB counters and, when due, each known link's state. It replaces
        3 + one-per-link calls with one; each field reads what its call would (the NVML field
        ids name the same counters). Link states are read every ``link_state_period_s``, on the
        first sample, on the sample after an XID of that GPU, and again while a read failed;
        in between a sample carries the last count. When the call itself fails, the fields are
        read by their own calls this round and the NVLink rates are None.
        """
        nv = self._nvml
        if dev.lost:  # died while its links were being learnt
            return None, None, None, None, None
        read_s = dev.states_read_s
        due = bool(known) and (
            read_s is None or not read_s <= now_s < read_s + self._link_state_period_s
        )
        values = self._field_values(dev, known, due and dev.states_by_field)
        if values is None:
            if dev.lost:
                return None, None, None, None, None
            ecc = self._try(
                dev,
                nv.nvmlDeviceGetTotalEccErrors,
                dev.handle,
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            )
            links = self._link_states(dev, known, now_s, None) if due else dev.nvlink_active
            return _int_or_none(ecc), self._retired_pages(dev), links, None, None
        plain = _plain_values(nv, values)
        if plain is not None:  # every field answered (the usual case)
            if not known:
                return plain[0], plain[1] + plain[2], None, None, None
            tx, rx = self._nvlink_rates(dev, now_s, plain[3], plain[4])
            links = dev.nvlink_active
            if due:
                states: list[tuple[int, int | float | None]] | None = None
                if dev.states_by_field:
                    states = [(0, v) for v in plain[5:]]
                links = self._link_states(dev, known, now_s, states)
            return plain[0], plain[1] + plain[2], links, tx, rx
        results = _field_results(nv, values)
        ecc = self._field(dev, results[0])
        sbe, dbe = self._field(dev, results[1]), self._field(dev, results[2])
        retired = None if sbe is None and dbe is None else int(sbe or 0) + int(dbe or 0)
        if not known:
            return _int_or_none(ecc), retired, None, None, None
        tx_kib, rx_kib = self._field(dev, results[3]), self._field(dev, results[4])
        tx, rx = self._nvlink_rates(dev, now_s, tx_kib, rx_kib)
        links = dev.nvlink_active
        if due:
            by_field = results[5:] if dev.states_by_field else None
            links = self._link_states(dev, known, now_s, by_field)
        return _int_or_none(ecc), retired, links, tx, rx

    def _link_states(
        self,
        dev: _Device,
        known: tuple[int, ...],
        now_s: float,
        by_field: list[tuple[int, int | float | None]] | None,
    ) -> int | None:
        """Active links read now (from the state fields, else by call), remembered till due."""
        if by_field is not None:
            active = self._nvlink_states_by_field(dev, known, by_field)
        else:
            active = self._nvlink_states_by_call(dev, known)
        dev.nvlink_active = active
        dev.states_read_s = now_s if active is not None else None  # a failed read: again next
        return active

    def _field_values(self, dev: _Device, known: tuple[int, ...], states: bool) -> Any | None:
        """The device's field-values request answered (an nvmlFieldValue_t array), or None."""
        nv = self._nvml
        request = dev.requests.get(states)
        if request is None:
            request = _field_request(nv, known, states)
            if self._c_field_values is not None:
                values = (nv.c_nvmlFieldValue_t * len(request))()
                for i, (field_id, scope) in enumerate(request):
                    values[i].fieldId, values[i].scopeId = field_id, scope
                request = (ctypes.c_int32(len(values)), ctypes.byref(values), values)
            dev.requests[states] = request
        c_fn = self._c_field_values
        if c_fn is None:
            return self._try(dev, nv.nvmlDeviceGetFieldValues, dev.handle, request)
        count, ref, values = request
        code = c_fn(dev.handle, count, ref)  # NVML writes every field's result in place
        if code != 0:
            self._refused(dev, "nvmlDeviceGetFieldValues", nv.NVMLError(code))
            return None
        return values

    def _field(self, dev: _Device, result: tuple[int, int | float | None]) -> int | float | None:
        """One field's value, or None when NVML returned an error for it (lost marks ``dev``)."""
        code, value = result
        if code == 0:
            return value
        if code in self._lost_codes():
            dev.lost = True
        self._log_once(dev, "nvmlDeviceGetFieldValues", code, f"field error {code}")
        return None

    def _nvlink_states_by_field(
        self, dev: _Device, known: tuple[int, ...], results: list[tuple[int, int | float | None]]
    ) -> int | None:
        """Active links from the NVML_FI_DEV_NVLINK_GET_STATE fields (active or asleep: up).

        A driver without that field says NOT_SUPPORTED (or INVALID_ARGUMENT) for every link:
        from then on this device's states are read link by link, starting this round.
        """
        nv = self._nvml
        absent = (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_INVALID_ARGUMENT)
        if results and all(code in absent for code, _ in results):
            log.debug("nvml: %s: no NVLink state field, reading links by call", dev.uuid)
            dev.states_by_field = False
            dev.requests.pop(True, None)
            return self._nvlink_states_by_call(dev, known)
        up = (nv.NVML_NVLINK_STATE_ACTIVE, nv.NVML_NVLINK_STATE_SLEEP)
        answered = active = 0
        for code, state in results:
            if code:
                self._field(dev, (code, state))  # logged once; "GPU is lost" marks the GPU
            else:
                answered += 1
                active += state in up
        return active if answered else None

    def _unhealthy_sample(self, dev: _Device) -> GpuSample:
        """A lost GPU: unhealthy, no free memory (so nothing schedules onto it), no readings.

        Identity, class and domain are the last known ones, so consumers know which block lost it.
        """
        dev.lost = True
        dev.processes, dev.processes_read_s = (), None
        xids, dev.xids = tuple(dev.xids), []
        total = dev.memory_total_bytes
        return gpu_sample(
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
        # a GPU back from lost: read again at once
        dev.states_read_s = dev.mig_read_s = dev.processes_read_s = None
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

    def _nvlink_links(self, dev: _Device) -> tuple[int, ...] | None:
        """The link indices NVML answers for, learnt once; None while the GPU dies during it."""
        nv = self._nvml
        if dev.nvlink_links is None:
            answered: list[int] = []
            for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
                if self._try(dev, nv.nvmlDeviceGetNvLinkState, dev.handle, link) is not None:
                    answered.append(link)
            if dev.lost:
                return None  # learn the links from a healthy GPU, not a dying one
            dev.nvlink_links = tuple(answered)
        return dev.nvlink_links

    def _nvlink_states_by_call(self, dev: _Device, known: tuple[int, ...]) -> int | None:
        """Active links, one nvmlDeviceGetNvLinkState per known link (drivers without the field)."""
        nv = self._nvml
        get_state, handle = nv.nvmlDeviceGetNvLinkState, dev.handle
        try:
            # NOTE: one guard for the whole round, not one _try per link: up to 18 links per GPU
            # every second; when a link refuses, the round is read again link by link below.
            states: list[int | None] = [get_state(handle, i) for i in known]
        except self._errors:
            states = [self._try(dev, get_state, handle, i) for i in known]
        answered = [s for s in states if s is not None]
        return sum(1 for s in answered if s == nv.NVML_FEATURE_ENABLED) if answered else None

    def _nvlink_rates(
        self, dev: _Device, now_s: float, tx_kib: float | None, rx_kib: float | None
    ) -> tuple[float | None, float | None]:
        """Bytes/s from NVML's cumulative KiB counters (summed over links); None on first read."""
        if tx_kib is None or rx_kib is None:
            dev.nvlink_prev = None
            return None, None
        prev, dev.nvlink_prev = dev.nvlink_prev, (now_s, int(tx_kib), int(rx_kib))
        if prev is None or now_s <= prev[0] or tx_kib < prev[1] or rx_kib < prev[2]:
            return None, None  # first read, or the counters were reset
        dt_s = now_s - prev[0]
        return (tx_kib - prev[1]) * KIB / dt_s, (rx_kib - prev[2]) * KIB / dt_s

    def _pcie(self, dev: _Device, counter: int) -> float | None:
        # NOTE: NVML reports PCIe throughput in KB/s over a 20 ms window; NVML's KB are KiB.
        kb_s = self._try(dev, self._nvml.nvmlDeviceGetPcieThroughput, dev.handle, counter)
        return float(kb_s) * KIB if kb_s is not None else None

    def _mig_mode(self, dev: _Device, now_s: float) -> bool | None:
        """The current MIG mode, read as rarely as the link states (it changes on a GPU reset)."""
        read_s = dev.mig_read_s
        if read_s is not None and read_s <= now_s < read_s + self._link_state_period_s:
            return dev.mig_mode
        modes = self._try(dev, self._nvml.nvmlDeviceGetMigMode, dev.handle)
        dev.mig_mode = bool(modes[0] == _MIG_ENABLED) if modes is not None else None
        dev.mig_read_s = now_s
        return dev.mig_mode

    def _processes(self, dev: _Device) -> tuple[GpuProcess, ...]:
        """Compute and graphics processes, one entry per pid (the larger memory figure)."""
        nv = self._nvml
        lists = []
        for getter in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            procs = self._try(dev, getattr(nv, getter), dev.handle)
            if procs is None and hasattr(nv, getter + "_v2"):  # library older than the v3 call
                procs = self._try(dev, getattr(nv, getter + "_v2"), dev.handle)
            lists.append(procs or ())
        return _merge_processes(lists)

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
            # an NVLink failure raises an XID: read the links, MIG mode and processes at the
            # next sample
            dev.states_read_s = dev.mig_read_s = dev.processes_read_s = None
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


def _field_request(nv: Any, links: tuple[int, ...], states: bool) -> list[tuple[int, int]]:
    """The field ids (with scope) of :meth:`NvmlSampler._counters`' call, in its order."""
    ids = [
        (nv.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 0),  # = GetTotalEccErrors(UNCORRECTED, VOLATILE)
        (nv.NVML_FI_DEV_RETIRED_SBE, 0),  # = len(GetRetiredPages(MULTIPLE_SINGLE_BIT_ECC))
        (nv.NVML_FI_DEV_RETIRED_DBE, 0),  # = len(GetRetiredPages(DOUBLE_BIT_ECC))
    ]
    if links:
        ids += [
            (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _UINT_MAX),
            (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _UINT_MAX),
        ]
        if states:
            ids += [(nv.NVML_FI_DEV_NVLINK_GET_STATE, link) for link in links]
    return ids


_Layout = tuple[struct.Struct, dict[int, Callable[..., tuple[Any, ...]]]]
_LAYOUTS: dict[type, _Layout | None] = {}


def _layout(nv: Any, cls: type) -> _Layout | None:
    """How to read an nvmlFieldValue_t array in one C pass: the record's (valueType,
    nvmlReturn, raw value) and each value type's decoder, from the ctypes structure's own
    offsets; None where that does not apply (big-endian, an unexpected layout)."""
    if cls in _LAYOUTS:
        return _LAYOUTS[cls]
    layout = None
    try:
        t, r, v = (getattr(cls, f).offset for f in ("valueType", "nvmlReturn", "value"))
        size = ctypes.sizeof(cls)
        fmt = f"={t}xI{r - t - 4}xI{v - r - 4}xQ{size - v - 8}x"  # value: its 8 raw bytes
        record = struct.Struct(fmt)
        if sys.byteorder == "little" and t + 4 <= r and r + 4 <= v and record.size == size:
            ulong = "=Q" if ctypes.sizeof(ctypes.c_ulong) == 8 else "=I"
            decoders = {
                nv.NVML_VALUE_TYPE_DOUBLE: struct.Struct("=d").unpack_from,
                nv.NVML_VALUE_TYPE_UNSIGNED_INT: struct.Struct("=I").unpack_from,
                nv.NVML_VALUE_TYPE_UNSIGNED_LONG: struct.Struct(ulong).unpack_from,
                nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: struct.Struct("=Q").unpack_from,
                nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: struct.Struct("=q").unpack_from,
                nv.NVML_VALUE_TYPE_SIGNED_INT: struct.Struct("=i").unpack_from,
            }
            layout = (record, decoders)
    except (AttributeError, struct.error, ValueError):
        layout = None
    _LAYOUTS[cls] = layout
    return layout


_ARRAY_READERS: dict[type, Callable[..., tuple[int, ...]] | None] = {}


def _plain_values(nv: Any, values: Any) -> list[int] | None:
    """Every field's value when each one succeeded as an unsigned integer, else None.

    NOTE: the usual answer (ECC, retired pages, NVLink counters and states all read) in one
    unpack of the whole array; anything else goes through :func:`_field_results`.
    """
    cls = type(values)
    if cls not in _ARRAY_READERS:
        layout = _layout(nv, getattr(values, "_type_", type(None)))
        length = getattr(cls, "_length_", None)
        whole = None
        if layout is not None and length:
            whole = struct.Struct("=" + layout[0].format.lstrip("=") * length).unpack_from
        _ARRAY_READERS[cls] = whole
    reader = _ARRAY_READERS[cls]
    if reader is None:
        return None
    flat = reader(values)
    if any(flat[1::3]):  # a field's nvmlReturn
        return None
    types, raws = flat[0::3], flat[2::3]
    ull = types.count(nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)
    if ull == len(types):
        return list(raws)
    uint = nv.NVML_VALUE_TYPE_UNSIGNED_INT
    if ull + types.count(uint) != len(types):
        return None
    return [raw & 0xFFFFFFFF if t == uint else raw for t, raw in zip(types, raws, strict=True)]


def _field_results(nv: Any, values: Any) -> list[tuple[int, int | float | None]]:
    """``(nvmlReturn, value)`` of each nvmlFieldValue_t (value None for an unknown type).

    NOTE: read from the array's bytes in one pass: pynvml's structures convert every attribute
    read in Python (``__getattribute__``), three per field, ~20 fields per GPU every second.
    """
    layout = _layout(nv, getattr(values, "_type_", type(None)))
    if layout is None:
        return [(int(fv.nvmlReturn), _field_value(nv, fv)) for fv in values]
    record, decoders = layout
    ull, uint = nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nv.NVML_VALUE_TYPE_UNSIGNED_INT
    out: list[tuple[int, int | float | None]] = []
    for value_type, code, raw in record.iter_unpack(memoryview(values).cast("B")):
        if code:
            out.append((code, None))
        elif value_type == ull:
            out.append((0, raw))
        elif value_type == uint:
            out.append((0, raw & 0xFFFFFFFF))
        else:
            decode = decoders.get(value_type)
            out.append((0, decode(raw.to_bytes(8, "little"))[0] if decode else None))
    return out


def _field_value(nv: Any, fv: Any) -> int | float | None:
    """One nvmlFieldValue_t's value by attribute (the slow path), None on an error or type."""
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
    return getattr(fv.value, attr) if attr else None


def _merge_processes(lists: Any) -> tuple[GpuProcess, ...]:
    """NVML process lists as one entry per pid (the larger memory figure), sorted by pid."""
    used: dict[int, int | None] = {}
    for procs in lists:
        for p in procs:
            mem = _int_or_none(p.usedGpuMemory)
            prev = used.get(int(p.pid))
            used[int(p.pid)] = mem if prev is None else max(prev, mem or 0)
    return tuple(GpuProcess(pid, used[pid]) for pid in sorted(used))


_MEMORY_FIELDS = ("total", "reserved", "free", "used")
_STRUCT_READERS: dict[tuple[type, tuple[str, ...]], Callable[[Any], tuple[Any, ...]]] = {}


def _struct_reader(cls: type, names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """Reads the named unsigned integer fields of a ctypes structure in one C call.

    NOTE: pynvml's structures convert every attribute read in Python (``__getattribute__``);
    memory and utilisation are six reads per GPU every second. Falls back to attribute reads
    for anything that is not such a structure (a field missing reads None).
    """
    key = (cls, names)
    reader = _STRUCT_READERS.get(key)
    if reader is not None:
        return reader
    try:
        fields = [(getattr(cls, n).offset, getattr(cls, n).size) for n in names]
        fmt, at = "=", 0
        for offset, size in fields:
            fmt += f"{offset - at}x" + {4: "I", 8: "Q"}[size]
            at = offset + size
        unpack = struct.Struct(fmt).unpack_from
        if not issubclass(cls, ctypes.Structure) or at > ctypes.sizeof(cls):
            raise TypeError(cls)
        if [o for o, _ in fields] != sorted(o for o, _ in fields):
            raise TypeError(cls)
        reader = unpack
    except (AttributeError, KeyError, TypeError, struct.error):

        def reader(obj: Any) -> tuple[Any, ...]:
            return tuple(getattr(obj, n, None) for n in names)

    _STRUCT_READERS[key] = reader
    return reader


_MEMORY_READERS: dict[type, Callable[[Any], tuple[int, int | None, int, int]]] = {}


def _memory(mem: Any) -> tuple[int, int | None, int, int]:
    """(total, reserved or None, free, used) bytes of an nvmlMemory(_v2) structure."""
    read = _MEMORY_READERS.get(type(mem))
    if read is None:
        read = _MEMORY_READERS[type(mem)] = _memory_reader(type(mem))
    return read(mem)


def _memory_reader(cls: type) -> Callable[[Any], tuple[int, int | None, int, int]]:
    if not hasattr(cls, "reserved"):
        v1 = _struct_reader(cls, ("total", "free", "used"))

        def read_v1(mem: Any) -> tuple[int, int | None, int, int]:
            total, free, used = v1(mem)
            return int(total), None, int(free), int(used)

        return read_v1
    v2 = _struct_reader(cls, _MEMORY_FIELDS)
    if isinstance(v2, type(struct.Struct("=I").unpack_from)):  # C: already four ints
        return v2

    def read_v2(mem: Any) -> tuple[int, int | None, int, int]:
        total, reserved, free, used = v2(mem)
        return int(total), _int_or_none(reserved), int(free), int(used)

    return read_v2


def _utilization(util: Any) -> tuple[float, float]:
    """(SM %, memory %) of an nvmlUtilization structure."""
    sm, mem = _struct_reader(type(util), ("gpu", "memory"))(util)
    return float(sm), float(mem)


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
