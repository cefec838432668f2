"""Checks, not speed: a bundle's tokens under emulated CPUs (aarch64, AVX2-only x86) against this
machine's, and a seeded request's isolation from other tenants (a regression check)."""
