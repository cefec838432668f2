"""doel's benchmarks, probes and checks: each module runs as `python -m benchmarks.NAME` from the
checkout's root and writes benchmarks/results/ (report.py, cpu_class.write_result). A package so
that the scripts import one another as `benchmarks.NAME`, with no edit of sys.path; nothing here
is imported by doel itself."""
