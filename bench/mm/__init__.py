"""Multi-model scheduling benchmark (``python -m bench.multimodel``): scenario, simulator, systems.

* :mod:`bench.mm.scenario` — the cluster (4 × 80 GB + 8 × 24 GB GPUs), the model catalogue and
  the seeded bursty workload with long-prompt spikes; both systems get the same one.
* :mod:`bench.mm.core` — the discrete-event simulator both systems run in: simulated clock,
  instances, queues, service times from the runtime's :class:`runtime.timing.ReplicaTiming`
  (gearbox's cost model), physical memory in the runtime's :class:`SimGpuPool`.
* :mod:`bench.mm.systems` — the two systems: round-robin, and ours (``gearbox.place_model`` +
  the runtime's watermark throttle and VMM reservation manager).
* :mod:`bench.mm.metrics` — counters and the time-integrated figures reported.
"""
