"""Real pipeline-parallel runtime for offline batches: stage workers and their controller."""
