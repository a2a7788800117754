"""A fake ``pynvml`` that behaves like the real module over a few scripted GPUs.

Fidelity first: constants, error classes and return structures are the real module's own (its
import does not load libnvidia-ml; only ``nvmlInit`` would). Handles are real ``c_nvmlDevice_t``
pointers, memory info is a real ``c_nvmlMemory_v2_t``, field values a real ``c_nvmlFieldValue_t``
array, events a real ``c_nvmlEventData_t``. Every function has the real name and parameter
names (``tests/probes/test_nvml.py`` checks that against the installed module).

Scripting: ``FakeGpu.fail["nvmlDeviceGetPowerUsage"] = NVML_ERROR_NOT_SUPPORTED`` makes one call
fail with that code (``MISMATCH``: NVMLLibraryMismatchError; the v2 memory call is named
``nvmlDeviceGetMemoryInfo_v2`` there, as in the C library); ``FakeGpu.lost = True`` makes every
device call raise ``GPU is lost``; ``FakeNvml.push_xid(index, xid)`` queues an XID event.
``nvmlDeviceGetFieldValues`` answers the field ids the sampler asks for (ECC, retired pages, NVLink
counters and per-link state) from the same scripted state as the dedicated calls;
``FakeGpu.field_fail[field_id] = code`` makes one field come back with that error, and
``nvlink_state_field_supported = False`` is a driver without ``NVML_FI_DEV_NVLINK_GET_STATE``.
"""

from __future__ import annotations

import ctypes
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pynvml as real

GIB = 1024**3
# nvmlFieldValue_t's (valueType, nvmlReturn, value) as the C library writes them
_FIELD_AT = real.c_nvmlFieldValue_t.valueType.offset
_FIELD_RESULT = struct.Struct("=IIQ")  # contiguous in the real struct: checked in the tests
_FIELD_SIZE = ctypes.sizeof(real.c_nvmlFieldValue_t)
_FIELD_ID = struct.Struct("=II")  # (fieldId, scopeId) at the start of the struct
_FI_NVLINK_STATE = real.NVML_FI_DEV_NVLINK_GET_STATE
_FI_NVLINK_COUNTERS = (
    real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
)
_UINT, _ULL = real.NVML_VALUE_TYPE_UNSIGNED_INT, real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
MISMATCH = -1  # a FakeGpu.fail code: raise NVMLLibraryMismatchError, as unversioned calls do


class _CWrites:
    """What the C library writes into a pynvml structure: its fields, straight into its memory
    (pynvml's structures turn each Python attribute write into a Python call, C does not)."""

    def __init__(self, cls: Any, names: tuple[str, ...]) -> None:
        fields = [(getattr(cls, n).offset, getattr(cls, n).size) for n in names]
        assert fields == sorted(fields), "names in the structure's order"
        fmt, at = "=", 0
        for offset, size in fields:
            fmt += f"{offset - at}x" + {4: "I", 8: "Q"}[size]
            at = offset + size
        self._pack_into = struct.Struct(fmt).pack_into

    def fill(self, obj: Any, *values: int) -> None:
        """Write ``values`` (in the order of the names given) into ``obj``."""
        self._pack_into(obj, 0, *values)


_MEMORY_V1 = _CWrites(real.c_nvmlMemory_t, ("total", "free", "used"))
_MEMORY_V2 = _CWrites(real.c_nvmlMemory_v2_t, ("total", "reserved", "free", "used"))
_UTILIZATION = _CWrites(real.c_nvmlUtilization_t, ("gpu", "memory"))


@dataclass
class FakeGpu:
    """One scripted GPU; NVML units (bytes, mW, KiB counters, KB/s)."""

    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 80 * GIB
    memory_reserved: int = 512 << 20
    memory_used: int = 10 * GIB
    util_gpu: int = 40
    util_memory: int = 25
    power_mw: int = 350_000
    temperature_c: int = 55
    ecc_uncorrected: int = 0
    retired_single_bit: list[int] = field(default_factory=list)  # page addresses
    retired_double_bit: list[int] = field(default_factory=list)
    nvlink_states: list[int] = field(default_factory=lambda: [1] * 18)  # [] = no NVLink
    nvlink_tx_kib: int = 0  # cumulative, summed over links
    nvlink_rx_kib: int = 0
    nvlink_counters_supported: bool = True  # False: field values come back NOT_SUPPORTED
    nvlink_state_field_supported: bool = True  # False: a driver before NVML_FI_DEV_NVLINK_GET_STATE
    field_fail: dict[int, int] = field(default_factory=dict)  # field id -> that field's error
    pcie_tx_kb_s: int = 1000
    pcie_rx_kb_s: int = 2000
    mig_mode: tuple[int, int] = (0, 0)  # (current, pending)
    compute_procs: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    graphics_procs: list[tuple[int, int | None]] = field(default_factory=list)
    supported_events: int = real.nvmlEventTypeAll
    fail: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    lost: bool = False


class FakeNvml:
    """Module-like object: ``FakeNvml(gpus)`` is passed where ``pynvml`` would be."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None) -> None:
        for name in dir(real):
            if name.startswith(("NVML", "nvmlEventType", "nvmlMemory_v", "nvmlTemperature_v")):
                setattr(self, name, getattr(real, name))
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = False
        self.calls: list[str] = []
        self.events: deque[tuple[int, int, int]] = deque()  # (gpu index, event type, data)
        self.registered: dict[int, int] = {}  # gpu index -> event mask
        self.event_sets_freed = 0
        self._structs = [real.struct_c_nvmlDevice_t() for _ in gpus]
        # NOTE: a handle is found by its struct's address in O(1): bench.agent times the agent
        # through this fake, and a scan over the GPUs per call would bill the fake to the agent.
        self._index_of = {ctypes.addressof(s): i for i, s in enumerate(self._structs)}
        self._handles: list[Any] = []
        self._handed_out: dict[int, int] = {}
        self._event_set = real.c_nvmlEventSet_t(real.struct_c_nvmlEventSet_t())
        self.c_nvmlFieldValue_t = real.c_nvmlFieldValue_t
        self.c_functions = True  # False: a pynvml whose _nvmlGetFunctionPointer finds nothing
        self._field_array: Any = None  # the last array the C field-values function filled

    # -- scripting -------------------------------------------------------------------------

    def push_xid(self, index: int, xid: int) -> None:
        """Queue an XID critical-error event for GPU ``index``."""
        self.events.append((index, real.nvmlEventTypeXidCriticalError, xid))

    # -- internals -------------------------------------------------------------------------

    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        self.calls.append(fn)
        # NOTE: the real library hands the handle to C untouched; the handles this fake gave out
        # are found by identity (kept alive in _handed_out), any other pointer by its address.
        index = self._handed_out.get(id(handle))
        if index is None:
            index = self._index_of[ctypes.addressof(handle.contents)]
        gpu = self.gpus[index]
        if gpu.lost:
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        if gpu.fail.get(fn) == MISMATCH:
            raise real.NVMLLibraryMismatchError(f"{fn}: use a versioned function")
        if fn in gpu.fail:
            raise real.NVMLError(gpu.fail[fn])
        return gpu

    def _handle(self, index: int) -> Any:
        return ctypes.pointer(self._structs[index])

    def _handle_out(self, index: int) -> Any:
        handle = self._handle(index)
        self._handles.append(handle)
        self._handed_out[id(handle)] = index
        return handle

    # -- library -----------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise real.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if index >= len(self.gpus):
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        handle = self._handle_out(index)
        self._gpu(handle, "nvmlDeviceGetHandleByIndex")
        return handle

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    # -- device state --------------------------------------------------------------------------

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo" + ("_v2" if version else ""))
        free = gpu.memory_total - gpu.memory_reserved - gpu.memory_used
        if not version:
            mem = real.c_nvmlMemory_t()
            _MEMORY_V1.fill(mem, gpu.memory_total, free, gpu.memory_used)
            return mem
        mem = real.c_nvmlMemory_v2_t()
        mem.version = version  # pynvml's own write; the rest is the C library's
        _MEMORY_V2.fill(mem, gpu.memory_total, gpu.memory_reserved, free, gpu.memory_used)
        return mem

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        util = real.c_nvmlUtilization_t()
        _UTILIZATION.fill(util, gpu.util_gpu, gpu.util_memory)
        return util

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetTemperatureV(
        self, handle: Any, sensor: int, version: int = real.nvmlTemperature_v1
    ) -> int:
        return self._gpu(handle, "nvmlDeviceGetTemperatureV").temperature_c

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        return gpu.ecc_uncorrected if errorType == real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        gpu = self._gpu(device, "nvmlDeviceGetRetiredPages")
        double = sourceFilter == real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        return list(gpu.retired_double_bit if double else gpu.retired_single_bit)

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetNvLinkState")
        if not gpu.nvlink_states:
            raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(gpu.nvlink_states):
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlink_states[link]

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        # What pynvml itself does in Python before the C call (the agent pays it on a real GPU).
        values = (real.c_nvmlFieldValue_t * len(fieldIds))()
        for i, fieldId in enumerate(fieldIds):
            try:
                (values[i].fieldId, values[i].scopeId) = fieldId
            except TypeError:
                values[i].fieldId = fieldId
        count = ctypes.c_int32(len(fieldIds))
        real._nvmlCheckReturn(self._c_nvmlDeviceGetFieldValues(handle, count, ctypes.byref(values)))
        return values

    @property
    def last_field_ids(self) -> list[tuple[int, int]]:
        """(field id, scope) of the last field-values request."""
        values = self._field_array
        return [] if values is None else [(v.fieldId, v.scopeId) for v in values]

    def _c_nvmlDeviceGetFieldValues(self, handle: Any, count: Any, values_ref: Any) -> int:
        """The C function: fills each requested field in place and returns an NVML code."""
        try:
            gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        except real.NVMLError as exc:
            return int(exc.value)
        except real.NVMLLibraryMismatchError:
            return int(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        values = self._field_array = values_ref._obj
        # written through the buffer as C writes it, not through pynvml's per-attribute Python
        buf = memoryview(values).cast("B")
        for i in range(count.value):
            at = i * _FIELD_SIZE
            field_id, scope = _FIELD_ID.unpack_from(buf, at)
            code, value_type, value = self._field(gpu, field_id, scope)
            _FIELD_RESULT.pack_into(buf, at + _FIELD_AT, value_type, code, value)
        return int(real.NVML_SUCCESS)

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        """pynvml's C-function lookup; only the field-values function is faked."""
        if not self.c_functions or name != "nvmlDeviceGetFieldValues":
            raise real.NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._c_nvmlDeviceGetFieldValues

    def _field(self, gpu: FakeGpu, field_id: int, scope: int) -> tuple[int, int, int]:
        """(nvmlReturn, valueType, value) of one field, from the GPU's scripted state."""
        if gpu.field_fail and field_id in gpu.field_fail:
            return gpu.field_fail[field_id], 0, 0
        if field_id == _FI_NVLINK_STATE and gpu.nvlink_state_field_supported:
            if not gpu.nvlink_states:
                return real.NVML_ERROR_NOT_SUPPORTED, 0, 0
            if scope >= len(gpu.nvlink_states):
                return real.NVML_ERROR_INVALID_ARGUMENT, 0, 0
            return real.NVML_SUCCESS, _UINT, gpu.nvlink_states[scope]
        if field_id in _FI_NVLINK_COUNTERS and gpu.nvlink_states and gpu.nvlink_counters_supported:
            tx = field_id == real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
            return real.NVML_SUCCESS, _ULL, gpu.nvlink_tx_kib if tx else gpu.nvlink_rx_kib
        if field_id == real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL:
            return real.NVML_SUCCESS, _ULL, gpu.ecc_uncorrected
        if field_id == real.NVML_FI_DEV_RETIRED_SBE:
            return real.NVML_SUCCESS, _ULL, len(gpu.retired_single_bit)
        if field_id == real.NVML_FI_DEV_RETIRED_DBE:
            return real.NVML_SUCCESS, _ULL, len(gpu.retired_double_bit)
        return real.NVML_ERROR_NOT_SUPPORTED, 0, 0

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetPcieThroughput")
        return gpu.pcie_tx_kb_s if counter == real.NVML_PCIE_UTIL_TX_BYTES else gpu.pcie_rx_kb_s

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        return list(self._gpu(device, "nvmlDeviceGetMigMode").mig_mode)

    def _procs(self, procs: list[tuple[int, int | None]]) -> list[Any]:
        out = []
        for pid, used in procs:
            obj = real.nvmlStructToFriendlyObject(real.c_nvmlProcessInfo_v3_t(pid, used or 0, 0, 0))
            if used is None:  # what the real module does with NVML_VALUE_NOT_AVAILABLE
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return self._procs(gpu.compute_procs)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses_v2")
        return self._procs(gpu.compute_procs)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return self._procs(gpu.graphics_procs)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses_v2")
        return self._procs(gpu.graphics_procs)

    # -- events --------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        self.calls.append("nvmlEventSetCreate")
        return self._event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetSupportedEventTypes").supported_events

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        self.registered[self.gpus.index(gpu)] = eventTypes

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        self.calls.append(f"nvmlEventSetWait_v2({timeoutms})")
        while self.events:
            index, event_type, data = self.events.popleft()
            if not self.registered.get(index, 0) & event_type:
                continue  # not registered: NVML would never deliver it
            event = real.c_nvmlEventData_t()
            event.device = self._handle(index)
            event.eventType, event.eventData = event_type, data
            event.gpuInstanceId = event.computeInstanceId = 0xFFFFFFFF
            return event
        raise real.NVMLError(real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self.calls.append("nvmlEventSetFree")
        self.event_sets_freed += 1
