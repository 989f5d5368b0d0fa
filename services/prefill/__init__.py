"""The prefill worker: computes a prompt's KV and first token, pushes the KV to a decode worker."""
