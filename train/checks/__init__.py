"""The verification suite: `suite` runs the checks on what a run will use and writes the report;
`base` holds what they share (VerifyConfig, Setup, CheckResult, the float64 twin) and the
gradient-flow check; one module a concern: ties, parity, causal, steps (step, accumulation,
resume, throughput), inputs (data and tokenizer)."""
