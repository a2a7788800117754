"""FlexPipe core: configuration, the event envelope and schemas, the topic catalog, local Kafka."""

__version__ = "0.1.0"
