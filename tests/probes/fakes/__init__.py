"""Fakes for the probes tests: a pynvml look-alike and fake CUDA libraries (C sources)."""
