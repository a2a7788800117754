"""NvmlSampler over the fake pynvml: every field, every error path, XID events, MIG, processes."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pynvml
import pytest
from pydantic import TypeAdapter

from flexpipe.schemas import ClusterEvent, ClusterEventType, GpuProcess, GpuSample, SampleReason
from gearbox.presets import GPU_CLASSES
from probes.nvml import NvmlSampler, NvmlUnavailable, default_resolver, open_nvml_sampler
from probes.nvml import sampler as sampler_module
from tests.probes.fakes.pynvml_fake import GIB, MISMATCH, FakeGpu, FakeNvml

pytestmark = pytest.mark.unit

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def make_gpu(index: int = 0, **overrides: Any) -> FakeGpu:
    """A healthy H100 with distinct uuid; overrides set any FakeGpu field."""
    fields: dict[str, Any] = {"uuid": f"GPU-{index:08d}"}
    fields.update(overrides)
    return FakeGpu(**fields)


def make_sampler(
    *gpus: FakeGpu, node: str = "n1", c_functions: bool = True, **kwargs: Any
) -> tuple[NvmlSampler, FakeNvml]:
    fake = FakeNvml(list(gpus) or [make_gpu()])
    fake.c_functions = c_functions
    return NvmlSampler(node, nvml=fake, **kwargs), fake


# -- the fake is faithful to the installed pynvml --------------------------------------------


def test_fake_functions_exist_in_real_pynvml_with_the_same_parameters() -> None:
    fake = FakeNvml([make_gpu()])
    names = [n for n in dir(fake) if n.startswith("nvml") and callable(getattr(fake, n))]
    assert "nvmlEventSetWait_v2" in names and "nvmlDeviceGetFieldValues" in names
    for name in names:
        real_fn = getattr(pynvml, name)
        real_params = list(inspect.signature(real_fn).parameters)
        fake_params = list(inspect.signature(getattr(fake, name)).parameters)
        assert fake_params == real_params, name


def test_fake_raises_the_real_error_classes() -> None:
    gpu = make_gpu(fail={"nvmlDeviceGetPowerUsage": NOT_SUPPORTED})
    fake = FakeNvml([gpu])
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(handle)
    gpu.lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUUID(handle)
    assert vars(fake)["NVMLError_Unknown"] is pynvml.NVMLError_Unknown


def test_sampler_calls_only_functions_the_real_module_has() -> None:
    sampler, fake = make_sampler(make_gpu(compute_procs=[(1, 1)]))
    fake.push_xid(0, 13)
    sampler.sample(1.0)
    sampler.poll_events(1.0)
    sampler.close()
    called = {c.split("(")[0].removesuffix("_v2") for c in fake.calls}
    missing = [c for c in called if not hasattr(pynvml, c)]
    assert missing == []


# -- every field ----------------------------------------------------------------------------


def test_full_sample_reads_every_field_in_schema_units() -> None:
    gpu = make_gpu(
        memory_total=80 * GIB,
        memory_reserved=1 * GIB,
        memory_used=30 * GIB,
        util_gpu=87,
        util_memory=42,
        power_mw=612_345,
        temperature_c=71,
        ecc_uncorrected=3,
        retired_single_bit=[0x1000, 0x2000],
        retired_double_bit=[0x3000],
        nvlink_states=[1, 1, 0, 1],
        pcie_tx_kb_s=5,
        pcie_rx_kb_s=7,
        compute_procs=[(4242, 20 * GIB), (17, None)],
    )
    sampler, _ = make_sampler(gpu)
    [s] = sampler.sample(10.0)
    assert s.gpu_uuid == "GPU-00000000" and s.node == "n1" and s.index == 0
    assert s.name == "NVIDIA H100 80GB HBM3" and s.reason is SampleReason.DELTA and s.healthy
    assert (s.gpu_class, s.domain) == ("h100-sxm", "n1/nvlink")
    assert s.memory_total_bytes == 80 * GIB
    assert s.memory_reserved_bytes == 1 * GIB
    assert s.memory_used_bytes == 30 * GIB
    assert s.memory_free_bytes == 49 * GIB
    assert (s.sm_util_pct, s.mem_util_pct) == (87.0, 42.0)
    assert s.power_w == pytest.approx(612.345)
    assert s.temperature_c == 71.0
    assert (s.ecc_uncorrected, s.retired_pages) == (3, 3)
    assert s.nvlink_active_links == 3
    assert (s.nvlink_tx_bytes_per_s, s.nvlink_rx_bytes_per_s) == (None, None)  # needs 2 reads
    assert (s.pcie_tx_bytes_per_s, s.pcie_rx_bytes_per_s) == (5 * 1024.0, 7 * 1024.0)
    assert s.mig_mode is False
    assert s.processes == (GpuProcess(17, None), GpuProcess(4242, 20 * GIB))
    assert s.xid_errors == ()


def test_samples_validate_against_the_strict_schema() -> None:
    sampler, _ = make_sampler(make_gpu(compute_procs=[(5, GIB)]), make_gpu(1, nvlink_states=[]))
    adapter = TypeAdapter(GpuSample)
    for s in sampler.sample(1.0):
        assert adapter.validate_python(s) == s


def test_nvlink_throughput_is_a_rate_from_cumulative_kib_counters() -> None:
    gpu = make_gpu(nvlink_tx_kib=1_000, nvlink_rx_kib=5_000)
    sampler, _ = make_sampler(gpu)
    sampler.sample(10.0)
    gpu.nvlink_tx_kib, gpu.nvlink_rx_kib = 3_000, 5_500
    [s] = sampler.sample(12.0)
    assert s.nvlink_tx_bytes_per_s == pytest.approx(2_000 * 1024 / 2)
    assert s.nvlink_rx_bytes_per_s == pytest.approx(500 * 1024 / 2)
    gpu.nvlink_tx_kib = 10  # counters reset (driver reload): no rate this round
    [s] = sampler.sample(13.0)
    assert s.nvlink_tx_bytes_per_s is None


def test_nvlink_per_field_error_yields_none_and_restarts_the_rate() -> None:
    gpu = make_gpu(nvlink_tx_kib=1)
    sampler, _ = make_sampler(gpu)
    sampler.sample(1.0)
    gpu.nvlink_counters_supported = False  # the call succeeds, each field says NOT_SUPPORTED
    [s] = sampler.sample(2.0)
    assert (s.nvlink_tx_bytes_per_s, s.nvlink_rx_bytes_per_s) == (None, None)
    assert s.nvlink_active_links == 18 and s.healthy
    gpu.nvlink_counters_supported = True
    assert sampler.sample(3.0)[0].nvlink_tx_bytes_per_s is None  # no stale baseline
    gpu.nvlink_tx_kib = 2
    assert sampler.sample(4.0)[0].nvlink_tx_bytes_per_s == pytest.approx(1024.0)


def test_nvlink_links_are_probed_once_then_read_in_the_one_field_values_call() -> None:
    sampler, fake = make_sampler(make_gpu(nvlink_states=[1, 0]), link_state_period_s=0)
    sampler.sample(1.0)
    first = fake.calls.count("nvmlDeviceGetNvLinkState")
    fake.calls.clear()
    [s] = sampler.sample(2.0)
    assert first == pynvml.NVML_NVLINK_MAX_LINKS  # discovery only
    assert "nvmlDeviceGetNvLinkState" not in fake.calls
    assert fake.calls.count("nvmlDeviceGetFieldValues") == 1
    state = pynvml.NVML_FI_DEV_NVLINK_GET_STATE
    assert [f for f in fake.last_field_ids if f[0] == state] == [(state, 0), (state, 1)]
    assert s.nvlink_active_links == 1


def test_one_call_per_sample_replaces_ecc_retired_pages_and_per_link_state_calls() -> None:
    sampler, fake = make_sampler(make_gpu(compute_procs=[(1, 2)]))
    sampler.sample(1.0)
    fake.calls.clear()
    sampler.sample(2.0)
    # was 31 with 18 links: 3 + 18 calls folded into one, MIG mode and processes not due yet
    assert len(fake.calls) == 7
    state = pynvml.NVML_FI_DEV_NVLINK_GET_STATE
    assert all(f[0] != state for f in fake.last_field_ids)  # link states: not due yet
    for name in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages"):
        assert name not in fake.calls
    assert "nvmlDeviceGetMigMode" not in fake.calls


def test_mig_mode_is_read_every_period_and_after_an_xid() -> None:
    gpu = make_gpu(mig_mode=(0, 1))
    sampler, fake = make_sampler(gpu)
    assert sampler.sample(1.0)[0].mig_mode is False
    gpu.mig_mode = (1, 1)  # enabled by an admin, in effect after a GPU reset
    assert sampler.sample(5.0)[0].mig_mode is False  # carried: read 4 s ago
    assert sampler.sample(11.0)[0].mig_mode is True
    gpu.mig_mode = (0, 0)
    fake.push_xid(0, 79)
    sampler.poll_events(11.5)
    assert sampler.sample(12.0)[0].mig_mode is False


def test_field_values_read_what_the_dedicated_calls_read() -> None:
    overrides: dict[str, Any] = {
        "ecc_uncorrected": 4,
        "retired_single_bit": [1, 2],
        "retired_double_bit": [3],
        "nvlink_states": [1, 0, 1, 1],
        "compute_procs": [(1, 2)],
    }
    [by_field] = make_sampler(make_gpu(**overrides))[0].sample(1.0)
    refused = {"nvmlDeviceGetFieldValues": NOT_SUPPORTED}
    [by_call] = make_sampler(make_gpu(fail=refused, **overrides))[0].sample(1.0)
    assert by_field == by_call
    assert (by_field.ecc_uncorrected, by_field.retired_pages) == (4, 3)
    assert by_field.nvlink_active_links == 3


@pytest.mark.parametrize("c_functions", [True, False])
def test_field_values_through_pynvml_when_the_c_function_is_not_found(c_functions: bool) -> None:
    gpu = make_gpu(ecc_uncorrected=2, retired_double_bit=[1], nvlink_tx_kib=1)
    sampler, fake = make_sampler(gpu, c_functions=c_functions)
    sampler.sample(1.0)
    gpu.nvlink_tx_kib, gpu.field_fail[pynvml.NVML_FI_DEV_RETIRED_DBE] = 3, NOT_SUPPORTED
    [s] = sampler.sample(2.0)
    assert (s.ecc_uncorrected, s.retired_pages, s.nvlink_active_links) == (2, 0, 18)
    assert s.nvlink_tx_bytes_per_s == pytest.approx(2 * 1024.0)
    assert fake.calls.count("nvmlDeviceGetFieldValues") == 2


def test_link_states_are_read_every_period_and_carried_in_between() -> None:
    gpu = make_gpu(nvlink_states=[1, 1, 1])
    sampler, fake = make_sampler(gpu, link_state_period_s=10.0)
    assert sampler.sample(1.0)[0].nvlink_active_links == 3
    gpu.nvlink_states = [1, 0, 1]
    state = pynvml.NVML_FI_DEV_NVLINK_GET_STATE
    for t in (2.0, 10.9):
        assert sampler.sample(t)[0].nvlink_active_links == 3  # the last read, 9.9 s old at most
        assert all(f[0] != state for f in fake.last_field_ids)
    assert sampler.sample(11.0)[0].nvlink_active_links == 2  # due: 10 s after the last read
    assert sampler.sample(12.0)[0].nvlink_active_links == 2


def test_an_xid_makes_the_link_states_due_at_the_next_sample() -> None:
    gpu = make_gpu(nvlink_states=[1, 1, 1])
    sampler, fake = make_sampler(gpu)
    sampler.sample(1.0)
    gpu.nvlink_states = [1, 0, 1]  # a link fails, NVML raises XID 74
    fake.push_xid(0, 74)
    sampler.poll_events(1.5)
    [s] = sampler.sample(2.0)
    assert s.nvlink_active_links == 2 and s.xid_errors == (74,)


def test_a_failed_link_state_read_is_tried_again_at_the_next_sample() -> None:
    gpu = make_gpu(nvlink_states=[1, 1])
    sampler, _ = make_sampler(gpu)
    gpu.field_fail[pynvml.NVML_FI_DEV_NVLINK_GET_STATE] = pynvml.NVML_ERROR_UNKNOWN
    assert sampler.sample(1.0)[0].nvlink_active_links is None
    del gpu.field_fail[pynvml.NVML_FI_DEV_NVLINK_GET_STATE]
    assert sampler.sample(2.0)[0].nvlink_active_links == 2


@pytest.mark.parametrize("state", [pynvml.NVML_NVLINK_STATE_SLEEP, 3])
def test_link_state_field_counts_active_and_asleep_links_as_up(state: int) -> None:
    gpu = make_gpu(nvlink_states=[1, 1])
    sampler, _ = make_sampler(gpu, link_state_period_s=0)
    sampler.sample(1.0)  # links learnt
    gpu.nvlink_states = [1, state]
    expected = 2 if state == pynvml.NVML_NVLINK_STATE_SLEEP else 1  # 3: traffic disabled
    assert sampler.sample(2.0)[0].nvlink_active_links == expected


def test_driver_without_the_link_state_field_reads_links_by_call() -> None:
    gpu = make_gpu(nvlink_states=[1, 0, 1], nvlink_state_field_supported=False)
    sampler, fake = make_sampler(gpu)
    assert sampler.sample(1.0)[0].nvlink_active_links == 2
    fake.calls.clear()
    gpu.nvlink_states = [1, 0, 0]
    assert sampler.sample(2.0)[0].nvlink_active_links == 2  # not due
    assert "nvmlDeviceGetNvLinkState" not in fake.calls
    assert sampler.sample(11.0)[0].nvlink_active_links == 1
    assert fake.calls.count("nvmlDeviceGetNvLinkState") == 3  # the known links, when due
    state = pynvml.NVML_FI_DEV_NVLINK_GET_STATE
    assert all(f[0] != state for f in fake.last_field_ids)


@pytest.mark.parametrize("by_field", [True, False])
@pytest.mark.parametrize(
    ("code", "healthy"), [(pynvml.NVML_ERROR_UNKNOWN, True), (pynvml.NVML_ERROR_GPU_IS_LOST, False)]
)
def test_known_links_that_start_failing_null_the_count_or_mark_the_gpu_lost(
    code: int, healthy: bool, by_field: bool
) -> None:
    gpu = make_gpu(nvlink_states=[1, 1, 0], nvlink_state_field_supported=by_field)
    sampler, _ = make_sampler(gpu, link_state_period_s=0)
    assert sampler.sample(1.0)[0].nvlink_active_links == 2  # links learnt
    if by_field:
        gpu.field_fail[pynvml.NVML_FI_DEV_NVLINK_GET_STATE] = code
    else:
        gpu.fail["nvmlDeviceGetNvLinkState"] = code
    [s] = sampler.sample(2.0)
    assert s.healthy is healthy and s.nvlink_active_links is None
    assert [e.type for e in sampler.poll_events(2.0)] == (
        [] if healthy else [ClusterEventType.GPU_ISOLATED]
    )


def test_gpu_without_nvlink_is_in_the_pcie_domain_and_not_probed_again() -> None:
    sampler, fake = make_sampler(make_gpu(name="NVIDIA L40S", nvlink_states=[]))
    [s] = sampler.sample(1.0)
    fake.calls.clear()
    sampler.sample(2.0)
    assert (s.gpu_class, s.domain, s.nvlink_active_links) == ("l40s", "n1/pcie", None)
    assert "nvmlDeviceGetNvLinkState" not in fake.calls
    nvlink = {
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        pynvml.NVML_FI_DEV_NVLINK_GET_STATE,
    }
    assert not {f[0] for f in fake.last_field_ids} & nvlink


def test_field_values_are_read_from_the_array_as_pynvml_would_read_them() -> None:
    values = (pynvml.c_nvmlFieldValue_t * 7)()
    cases = [
        (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 2.5),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 0xFFFFFFFE),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, "ulVal", 2**40),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 2**63 + 5),
        (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -(2**40)),
        (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "siVal", -7),
    ]
    for i, (value_type, attr, value) in enumerate(cases):
        values[i].valueType, values[i].nvmlReturn = value_type, 0
        setattr(values[i].value, attr, value)
    values[6].nvmlReturn = NOT_SUPPORTED
    fast = sampler_module._field_results(pynvml, values)
    slow = [(int(fv.nvmlReturn), sampler_module._field_value(pynvml, fv)) for fv in values]
    assert fast == slow
    assert [v for _, v in fast] == [c[2] for c in cases] + [None]
    assert fast[6][0] == NOT_SUPPORTED


def test_fake_writes_field_results_where_the_real_struct_has_them() -> None:
    cls = pynvml.c_nvmlFieldValue_t
    assert cls.nvmlReturn.offset == cls.valueType.offset + 4
    assert cls.value.offset == cls.nvmlReturn.offset + 4


# -- unsupported calls are null fields, never exceptions --------------------------------------

ECC = pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL
SBE, DBE = pynvml.NVML_FI_DEV_RETIRED_SBE, pynvml.NVML_FI_DEV_RETIRED_DBE
UNSUPPORTED_CASES = [  # (failing calls, failing fields of the field-values call, nulled fields)
    (["nvmlDeviceGetUtilizationRates"], [], ("sm_util_pct", "mem_util_pct")),
    (["nvmlDeviceGetPowerUsage"], [], ("power_w",)),
    ([], [ECC], ("ecc_uncorrected",)),
    ([], [SBE, DBE], ("retired_pages",)),
    (["nvmlDeviceGetNvLinkState"], [], ("nvlink_active_links",)),
    (["nvmlDeviceGetFieldValues"], [], ("nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s")),
    (
        ["nvmlDeviceGetFieldValues", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages"],
        [],
        ("nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s", "ecc_uncorrected", "retired_pages"),
    ),
    (["nvmlDeviceGetPcieThroughput"], [], ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s")),
    (["nvmlDeviceGetMigMode"], [], ("mig_mode",)),
]


@pytest.mark.parametrize("code", [NOT_SUPPORTED, pynvml.NVML_ERROR_UNKNOWN])
@pytest.mark.parametrize(("functions", "field_ids", "fields"), UNSUPPORTED_CASES)
def test_a_failing_call_or_field_nulls_its_fields_only(
    functions: list[str], field_ids: list[int], fields: tuple[str, ...], code: int
) -> None:
    gpu = make_gpu(
        fail=dict.fromkeys(functions, code),
        field_fail=dict.fromkeys(field_ids, code),
        compute_procs=[(1, 2)],
    )
    sampler, _ = make_sampler(gpu)
    [s] = sampler.sample(1.0)
    [reference] = make_sampler(make_gpu(compute_procs=[(1, 2)]))[0].sample(1.0)
    for name in GpuSample.__dataclass_fields__:
        expected = None if name in fields else getattr(reference, name)
        if name == "domain" and "nvlink_active_links" in fields:
            expected = "n1/pcie"
        assert getattr(s, name) == expected, name
    assert s.healthy


def test_a_refused_call_reads_the_gpu_call_by_call_then_one_guard_again_later() -> None:
    gpu = make_gpu(fail={"nvmlDeviceGetPowerUsage": NOT_SUPPORTED}, compute_procs=[(1, 2)])
    sampler, fake = make_sampler(gpu)
    [s] = sampler.sample(1.0)
    assert s.power_w is None and s.healthy and s.processes == (GpuProcess(1, 2),)
    fake.calls.clear()
    [s] = sampler.sample(2.0)  # read call by call now: the refused call once, nothing twice
    assert s.power_w is None and fake.calls.count("nvmlDeviceGetMemoryInfo_v2") == 1
    del gpu.fail["nvmlDeviceGetPowerUsage"]
    later = 1.0 + sampler_module._GUARDED_FOR_S
    assert sampler.sample(later - 0.5)[0].power_w == 350.0  # the guarded read answers too
    fake.calls.clear()
    [s] = sampler.sample(later)
    # one guard again: every call once (the process lists not due: memory did not move)
    assert s.power_w == 350.0 and len(fake.calls) == 7


def test_one_guard_and_call_by_call_reads_build_the_same_sample() -> None:
    def gpu() -> FakeGpu:
        return make_gpu(compute_procs=[(7, 3 * GIB)], graphics_procs=[(7, 4 * GIB), (8, None)])

    fast, _ = make_sampler(gpu())
    guarded, _ = make_sampler(gpu())
    guarded._fast = False
    for t in (1.0, 2.0, 12.0):
        assert fast.sample(t) == guarded.sample(t)


def test_a_gpu_lost_during_the_one_guard_read_is_unhealthy_and_isolated() -> None:
    gpu = make_gpu()
    sampler, _ = make_sampler(gpu)
    sampler.sample(1.0)
    gpu.lost = True
    [s] = sampler.sample(2.0)
    assert not s.healthy
    assert [e.type for e in sampler.poll_events(2.0)] == [ClusterEventType.GPU_ISOLATED]
    gpu.lost = False
    assert sampler.sample(3.0)[0].healthy
    assert [e.type for e in sampler.poll_events(3.0)] == [ClusterEventType.GPU_RESTORED]


def test_temperature_falls_back_to_the_deprecated_call_then_to_none() -> None:
    gpu = make_gpu(fail={"nvmlDeviceGetTemperatureV": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
    sampler, _ = make_sampler(gpu)
    assert sampler.sample(1.0)[0].temperature_c == 55.0
    gpu.fail["nvmlDeviceGetTemperature"] = NOT_SUPPORTED
    assert sampler.sample(2.0)[0].temperature_c is None


def test_memory_falls_back_to_v1_without_reserved() -> None:
    sampler, _ = make_sampler(make_gpu(fail={"nvmlDeviceGetMemoryInfo_v2": NOT_SUPPORTED}))
    [s] = sampler.sample(1.0)
    assert s.healthy and s.memory_total_bytes == 80 * GIB and s.memory_reserved_bytes is None
    assert s.memory_used_bytes == 10 * GIB


def test_no_memory_reading_at_all_is_an_unhealthy_sample() -> None:
    gpu = make_gpu(
        fail={
            "nvmlDeviceGetMemoryInfo_v2": pynvml.NVML_ERROR_UNKNOWN,
            "nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_UNKNOWN,
        }
    )
    [s] = make_sampler(gpu)[0].sample(1.0)
    assert not s.healthy and s.memory_free_bytes == 0


def test_processes_are_read_when_used_memory_moves_every_period_and_after_an_xid() -> None:
    gpu = make_gpu(compute_procs=[(1, GIB)])
    sampler, fake = make_sampler(gpu)
    assert sampler.sample(1.0)[0].processes == (GpuProcess(1, GIB),)
    reads = "nvmlDeviceGetComputeRunningProcesses"
    fake.calls.clear()
    first = sampler.sample(2.0)[0].processes
    assert reads not in fake.calls and first == (GpuProcess(1, GIB),)  # memory did not move
    gpu.compute_procs, gpu.memory_used = [(1, GIB), (2, GIB)], gpu.memory_used + GIB  # a start
    assert sampler.sample(3.0)[0].processes == (GpuProcess(1, GIB), GpuProcess(2, GIB))
    gpu.compute_procs = [(3, GIB), (2, GIB)]  # an exit and a start of the same size, unseen ...
    assert sampler.sample(12.9)[0].processes == (GpuProcess(1, GIB), GpuProcess(2, GIB))
    assert sampler.sample(13.0)[0].processes == (GpuProcess(2, GIB), GpuProcess(3, GIB))  # ... 10 s
    gpu.compute_procs = []
    fake.push_xid(0, 43)
    sampler.poll_events(13.5)
    assert sampler.sample(14.0)[0].processes == ()  # an XID: read at the next sample


def test_process_period_zero_reads_the_lists_every_sample() -> None:
    sampler, fake = make_sampler(make_gpu(), process_period_s=0)
    sampler.sample(1.0)
    fake.calls.clear()
    sampler.sample(2.0)
    assert fake.calls.count("nvmlDeviceGetComputeRunningProcesses") == 1
    assert fake.calls.count("nvmlDeviceGetGraphicsRunningProcesses") == 1


def test_a_gpu_back_from_lost_reads_its_processes_again() -> None:
    gpu = make_gpu(compute_procs=[(1, GIB)])
    sampler, _ = make_sampler(gpu)
    sampler.sample(1.0)
    gpu.lost = True
    assert sampler.sample(2.0)[0].processes == ()
    gpu.lost = False
    assert sampler.sample(3.0)[0].processes == (GpuProcess(1, GIB),)


def test_processes_merge_compute_and_graphics_by_pid() -> None:
    gpu = make_gpu(compute_procs=[(7, 3 * GIB), (9, GIB)], graphics_procs=[(7, 4 * GIB), (8, None)])
    [s] = make_sampler(gpu)[0].sample(1.0)
    assert s.processes == (GpuProcess(7, 4 * GIB), GpuProcess(8, None), GpuProcess(9, GIB))


def test_processes_fall_back_to_v2_on_library_mismatch() -> None:
    gpu = make_gpu(
        compute_procs=[(5, GIB)],
        fail={
            "nvmlDeviceGetComputeRunningProcesses": MISMATCH,
            "nvmlDeviceGetGraphicsRunningProcesses": NOT_SUPPORTED,
        },
    )
    sampler, fake = make_sampler(gpu)
    [s] = sampler.sample(1.0)
    assert s.processes == (GpuProcess(5, GIB),)
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.calls


def test_processes_unsupported_everywhere_is_an_empty_tuple() -> None:
    fail = {
        name: NOT_SUPPORTED
        for name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetGraphicsRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses_v2",
        )
    }
    [s] = make_sampler(make_gpu(compute_procs=[(1, 1)], fail=fail))[0].sample(1.0)
    assert s.processes == () and s.healthy


def test_gpus_of_pid_maps_a_process_to_every_gpu_that_lists_it() -> None:
    sampler, _ = make_sampler(
        make_gpu(0, compute_procs=[(100, GIB), (200, GIB)]),
        make_gpu(1, compute_procs=[(100, GIB)]),
    )
    assert sampler.gpus_of_pid() == {}  # nothing sampled yet
    sampler.sample(1.0)
    assert sampler.gpus_of_pid() == {100: ("GPU-00000000", "GPU-00000001"), 200: ("GPU-00000000",)}


@pytest.mark.parametrize(("modes", "expected"), [((1, 1), True), ((0, 1), False), ((1, 0), True)])
def test_mig_mode_is_the_current_mode(modes: tuple[int, int], expected: bool) -> None:
    gpu = make_gpu(mig_mode=modes, fail={"nvmlDeviceGetUtilizationRates": NOT_SUPPORTED})
    [s] = make_sampler(gpu)[0].sample(1.0)
    assert s.mig_mode is expected
    assert s.sm_util_pct is None  # NVML has no whole-GPU utilisation under MIG


# -- GPU lost -------------------------------------------------------------------------------


def test_lost_gpu_is_an_unhealthy_sample_and_one_isolation_event() -> None:
    sampler, fake = make_sampler(make_gpu(0, compute_procs=[(1, GIB)]), make_gpu(1))
    sampler.sample(1.0)
    fake.gpus[0].lost = True
    lost, other = sampler.sample(2.0)
    assert not lost.healthy and other.healthy
    assert lost.gpu_uuid == "GPU-00000000" and lost.name == "NVIDIA H100 80GB HBM3"
    assert (lost.memory_total_bytes, lost.memory_used_bytes, lost.memory_free_bytes) == (
        80 * GIB,
        80 * GIB,
        0,
    )
    assert (lost.gpu_class, lost.domain) == ("h100-sxm", "n1/nvlink")
    assert lost.power_w is None and lost.processes == ()
    assert sampler.gpus_of_pid() == {}
    assert sampler.poll_events(2.0) == [
        ClusterEvent(
            ClusterEventType.GPU_ISOLATED, "n1", ("GPU-00000000",), detail="NVML: GPU is lost"
        )
    ]
    sampler.sample(3.0)
    assert sampler.poll_events(3.0) == []  # once, not every round
    fake.gpus[0].lost = False
    assert sampler.sample(4.0)[0].healthy
    [restored] = sampler.poll_events(4.0)
    assert restored.type is ClusterEventType.GPU_RESTORED


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED])
def test_lost_half_way_through_a_sample_makes_it_unhealthy(code: int) -> None:
    sampler, _ = make_sampler(make_gpu(fail={"nvmlDeviceGetPowerUsage": code}))
    [s] = sampler.sample(1.0)
    assert not s.healthy and s.sm_util_pct is None
    [event] = sampler.poll_events(1.0)
    assert event.type is ClusterEventType.GPU_ISOLATED


def test_gpu_lost_before_start_gets_a_placeholder_identity_until_it_answers() -> None:
    sampler, fake = make_sampler(make_gpu(0, lost=True), make_gpu(1))
    lost, ok = sampler.sample(1.0)
    assert lost.gpu_uuid == "GPU-unknown-n1-0" and not lost.healthy
    assert ok.healthy
    fake.gpus[0].lost = False
    back, _ = sampler.sample(2.0)
    assert back.gpu_uuid == "GPU-00000000" and back.healthy


# -- XID events -----------------------------------------------------------------------------


def test_xid_becomes_a_cluster_event_and_lands_in_the_next_sample() -> None:
    sampler, fake = make_sampler(make_gpu(0), make_gpu(1))
    fake.push_xid(1, 79)
    fake.push_xid(1, 48)
    events = sampler.poll_events(1.0)
    assert [(e.type, e.gpu_uuids, e.xid) for e in events] == [
        (ClusterEventType.XID, ("GPU-00000001",), 79),
        (ClusterEventType.XID, ("GPU-00000001",), 48),
    ]
    assert events[0].detail == "XID 79"
    _, s = sampler.sample(2.0)
    assert s.xid_errors == (79, 48)
    _, s = sampler.sample(3.0)
    assert s.xid_errors == ()  # XIDs since the previous sample only


def test_event_wait_never_blocks_and_is_bounded() -> None:
    fake = FakeNvml([make_gpu()])
    sampler = NvmlSampler("n1", nvml=fake, max_events_per_poll=3)
    for xid in range(5):
        fake.push_xid(0, xid)
    assert [e.xid for e in sampler.poll_events(1.0)] == [0, 1, 2]
    assert [e.xid for e in sampler.poll_events(2.0)] == [3, 4]
    waits = {c for c in fake.calls if c.startswith("nvmlEventSetWait")}
    assert waits == {"nvmlEventSetWait_v2(0)"}


def test_device_without_xid_support_is_not_registered() -> None:
    sampler, fake = make_sampler(make_gpu(0), make_gpu(1, supported_events=0))
    assert fake.registered == {0: pynvml.nvmlEventTypeXidCriticalError}
    fake.push_xid(1, 31)
    assert sampler.poll_events(1.0) == []


def test_no_event_support_at_all_frees_the_set_and_polls_nothing() -> None:
    sampler, fake = make_sampler(
        make_gpu(fail={"nvmlDeviceRegisterEvents": NOT_SUPPORTED}),
    )
    assert fake.event_sets_freed == 1
    fake.calls.clear()
    assert sampler.poll_events(1.0) == []
    assert fake.calls == []


def test_event_wait_error_stops_the_poll_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    sampler, fake = make_sampler(make_gpu())

    def broken(eventSet: Any, timeoutms: int) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    fake.nvmlEventSetWait_v2 = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        assert sampler.poll_events(1.0) == []
        assert sampler.poll_events(2.0) == []
    assert len([r for r in caplog.records if "Unknown Error" in r.getMessage()]) == 1


# -- lifecycle and resolver -----------------------------------------------------------------


def test_init_failure_is_reported_not_raised_by_the_opener() -> None:
    fake = FakeNvml([make_gpu()], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        NvmlSampler("n1", nvml=fake)
    sampler, why = open_nvml_sampler("n1", nvml=fake)
    assert sampler is None and "Driver Not Loaded" in why
    sampler, why = open_nvml_sampler("n1", nvml=FakeNvml([make_gpu(), make_gpu(1)]))
    assert sampler is not None and why == "NVML with 2 GPU(s)"


def test_close_is_idempotent_and_stops_sampling() -> None:
    sampler, fake = make_sampler(make_gpu())
    sampler.close()
    sampler.close()
    assert fake.calls.count("nvmlShutdown") == 1 and fake.event_sets_freed == 1
    assert sampler.sample(1.0) == [] and sampler.poll_events(1.0) == []


def test_resolver_is_a_parameter() -> None:
    fake = FakeNvml([make_gpu()])
    sampler = NvmlSampler("n9", nvml=fake, resolver=lambda node, name, links: ("x", f"{node}/r"))
    [s] = sampler.sample(1.0)
    assert (s.gpu_class, s.domain) == ("x", "n9/r")


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-80g"),
        ("NVIDIA A100 80GB PCIe", "a100-80g"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA RTX A6000", "a6000-48g"),
        ("NVIDIA H200", None),
        ("NVIDIA A100-SXM4-40GB", None),
    ],
)
def test_default_resolver_maps_names_to_gearbox_classes(name: str, key: str | None) -> None:
    gpu_class, domain = default_resolver("n1", name, 0)
    assert gpu_class == key and domain == "n1/pcie"
    assert key is None or key in GPU_CLASSES
    assert default_resolver("n1", name, 4)[1] == "n1/nvlink"
