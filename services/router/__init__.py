"""The router: the OpenAI HTTP and gRPC APIs in front of a backend (one engine in this
process, or prefill and decode workers).

Its rooms, each one concern; a room imports only the rooms below it::

    __main__.py, app.py    wiring: flags (limit_flags.py too), the servers, the drain
    client.py              ``pdserve generate``: a client of grpc/
    http/   grpc/          the two public APIs: parse, answer, map errors  -> tools, pipeline
    tools/                 tool calling: tools and tool_choice, the Hermes format, replies
    pipeline/              tokenize, validate, admit, detokenize, stop     -> backends
    backends/              the Backend interface: colocated, disaggregated -> routing
    routing/               which workers: load and prefix-aware policies, the worker pool
    errors.py, deadline.py, metrics.py, model_info.py   what the rooms share (no router imports)
"""
