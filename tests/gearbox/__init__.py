"""Tests for gearbox, the pure decision core."""
