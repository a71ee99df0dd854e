"""The ground floor: errors, the phase clock, environment variables, cores, tuning, version. No torch."""
