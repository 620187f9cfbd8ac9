"""The benchmarks, a package: run each as ``python -m benchmarks.<name>`` from the repo root.
Their shared setup (timing, L2-cold rotation, tables, the tail's inputs) is :mod:`.common`;
the plain-PyTorch composites they time against are :mod:`kimi_ops.testing.composite`."""
