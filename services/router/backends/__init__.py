"""What the pipeline streams from: the Backend interface (backend.py) and its two kinds.

``ColocatedBackend`` runs one engine in this process. ``DisaggregatedBackend`` routes each
sample (sample.py) to workers and runs it on one of three paths, each its own object:
``RemotePath`` (prefill worker, then decode worker), ``LocalPath`` (one decode worker does
both) and ``Migration`` (a sample whose worker was lost goes on elsewhere). Every decode-side
token stream is read by one ``DecodeStream``; every failed worker call is mapped to the
router's errors in worker_errors.py.
"""
