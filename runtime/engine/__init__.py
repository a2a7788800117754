"""Inference engines behind one protocol: the simulated engine now, a torch engine next."""
