"""The decode worker: reserves blocks for remote KV, waits for it to land, streams tokens."""
