"""eBPF backend: CUDA kernel launches counted per process by uprobes, aggregated in the kernel.

Public API: :class:`EbpfLaunchCounter` (a ``probes.base.LaunchCounter``),
:func:`open_launch_counter` (the counter or the reason it cannot run), :func:`ebpf_available`.
BCC comes from Debian's ``python3-bpfcc`` (``deploy/bpf/setup.sh``); nothing here imports it at
module import time.
"""

from probes.ebpf.available import ebpf_available, find_kernel_source
from probes.ebpf.counter import EbpfLaunchCounter, EbpfUnavailable, open_launch_counter

__all__ = [
    "EbpfLaunchCounter",
    "EbpfUnavailable",
    "ebpf_available",
    "find_kernel_source",
    "open_launch_counter",
]
