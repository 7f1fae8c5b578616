"""Generated Open Inference Protocol messages and stubs (see generate.sh)."""
