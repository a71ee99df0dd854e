"""The ground floor: errors, the phase clock, environment variables, cores, tuning, version, the
Triton kernels' switch. No torch."""
