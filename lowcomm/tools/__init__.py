"""Tools around runs: ``lowcomm compare``, the benchmarks and the emulated WAN."""
