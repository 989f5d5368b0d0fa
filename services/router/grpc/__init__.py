"""pdserve's public gRPC API, ``GenerateService.Generate`` (servicer.py), and the one map from
the router's errors to gRPC status codes (status.py)."""
