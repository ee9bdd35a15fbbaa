"""Benchmarks: programs that measure and print, run by hand (``python -m bench.<name>``)."""
