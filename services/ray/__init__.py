"""pdserve on Ray Serve: the router as the ingress deployment, prefill, decode and the node's
kvstore as deployments with their own replica counts, each replica running the unchanged
``pdserve serve <role>`` gRPC service and publishing its address (builder.py has the graph).

    from services.ray.builder import build_pdserve_app
    serve.run(build_pdserve_app({"transfer": "grpc", "decode": {"num_replicas": 2}}))

KV bytes move worker to worker over NIXL or gRPC, never through Serve handles.
"""
