"""Node agents: GPU samplers (NVML, simulated) and kernel-launch counters (eBPF, simulated)."""
