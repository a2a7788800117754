"""Multi-model scheduling benchmark (``python -m bench.multimodel``): scenarios, simulator, systems.

* :mod:`bench.mm.scenario` — the ``fits`` scenario: the cluster (4 × 80 GB + 8 × 24 GB GPUs),
  a catalogue that fits statically and the seeded bursty workload with long-prompt spikes; every
  system gets the same one.
* :mod:`bench.mm.farm` — the ``farm`` scenario: 80/48/24 GB GPUs, a BERT-to-70B catalogue that
  does not fit statically, shifting Zipf popularity, load around capacity.
* :mod:`bench.mm.core` — the discrete-event simulator every system runs in: simulated clock,
  instances, queues, service times from the runtime's :class:`runtime.timing.ReplicaTiming`
  (gearbox's cost model), physical memory in the runtime's :class:`SimGpuPool`.
* :mod:`bench.mm.systems` — the four systems: naive and model-aware round-robin, vLLM-like
  static, and ours (the live stream's residency round, ``gearbox.residency``, + the runtime's
  watermark throttle, VMM floors and reservation manager).
* :mod:`bench.mm.metrics` — counters and the time-integrated figures reported.
"""
