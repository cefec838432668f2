"""doel's benchmarks, by the stage they measure (train, export, serve, load, web), with the
checks that are not speed (checks), the probes whose decisions are made (probes) and what every
result shares (common). Each module runs as `python -m benchmarks.STAGE.NAME` from the
checkout's root and writes benchmarks/results/ through common.report.publish alone. A package so
that the scripts import one another as `benchmarks.STAGE.NAME`, with no edit of sys.path;
nothing here is imported by doel itself."""
