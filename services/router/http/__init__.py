"""The OpenAI-compatible HTTP API: request bodies in (protocol.py), response bodies and SSE
chunks out (responses.py), API keys (auth.py), the router's errors as OpenAI error bodies
(errors.py), and the aiohttp server that ties them to the pipeline (server.py)."""
