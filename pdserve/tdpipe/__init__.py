"""TD-Pipe offline mode: decision policies, output-length predictor, simulator, and the batch job (runtime/)."""
