"""The simulated world: scenario files, simulated nodes and agents' backends, the load generator,
and the main job (``flexpipe up``, what ``make run`` runs) with its live view and report.

It drives the product as a user would — topics, stream worker, runtime worker — and the
product (``probes``, ``streams``, ``runtime``, ``gearbox``) never imports it.
"""
