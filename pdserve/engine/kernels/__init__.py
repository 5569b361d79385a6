"""The engine's compiled CPU ops (`csrc/`): paged and prompt attention, the AMX and float32 GEMMs,
the fused norm/SiLU ops and greedy sampling, built lazily into one library by `cpu_build`."""
