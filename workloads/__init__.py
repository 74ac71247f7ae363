"""GPU programs that the benchmarks (scripts/) and the GPU tests (tests/gpu/) both run.

Most are started as child processes, by path, under the tools (``gpu-trace run``, ``gpu-ckpt``);
``workloads.snapshot_trials`` is imported (the repository root on the path). Not part of the
installed package; scripts/README.md says how scripts and tests reach them.
"""
