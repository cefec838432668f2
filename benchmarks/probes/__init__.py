"""Probes whose decision is made: each stays runnable as the evidence behind that decision (its
results file says what was decided), and none runs in CI."""
