"""Discrete-event simulation of FlexPipe's fragmented-cluster evaluation (see bench.fragmented).

Built from the product's own code: gearbox decides and costs, the runtime's DeploymentRuntime
(transition machine, executor, serving core, router, VMM ledger) serves, the streams' load
windows feed the decisions, and probes' SimCluster plays the scenario's timeline — under a
simulated clock, without Kafka.
"""
