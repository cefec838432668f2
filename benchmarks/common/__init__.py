"""What every benchmark shares: the CPU it ran on (cpu_class) and the one way a result is
written (report.publish)."""
