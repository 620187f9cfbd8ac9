"""Scaffolding that tests and benchmarks share (not used by the decoder itself)."""
