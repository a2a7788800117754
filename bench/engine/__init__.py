"""Torch reference engine benchmark (``python -m bench.engine``)."""
