"""The torch reference engine: a Llama-style decoder served one process per rank.

``config`` and ``layout`` are pure (no torch import), so the runtime can plan re-partitions
without loading torch; ``model``, ``rank`` and ``engine`` need torch.
"""
