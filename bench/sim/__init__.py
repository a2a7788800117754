"""The fragmented-cluster benchmark's own parts (see bench.fragmented).

The world and the loop are the product's and the simulator's: :mod:`sim.world` joins the
simulated fleet's telemetry, the stream's fold and decision step (:class:`streams.replay.Replayer`)
and the runtime worker's core (:class:`runtime.host.RuntimeHost`) under a simulated clock,
without Kafka. Here only what a benchmark adds: the event loop and its measurements
(:mod:`.des`, :mod:`.metrics`), the compared systems (:mod:`.systems`, :mod:`.baselines`), and
the summary, report and plot. Engines are the product's SimEngine.
"""
