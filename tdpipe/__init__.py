"""TD-Pipe offline mode: decision policies, output-length predictor and simulator."""
