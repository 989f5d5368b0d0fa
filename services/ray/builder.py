"""``build_pdserve_app(args) -> Application``: the deployment graph, after Ray Serve LLM's
prefill/decode builder (``build_pd_openai_app``: validated args, one deployment per role, the
ingress in front).

    RouterIngress (HTTP, Serve's proxy)  ─┐
    PrefillReplica × N   ─ publish ─►  AddressBook  ◄─ long-poll ─ RouterIngress
    DecodeReplica  × M   ─ publish ─►
    KVStoreReplica (at most one per node)

Each role's ``num_replicas`` or ``autoscaling_config`` and ``ray_actor_options`` come from its
RoleConfig. Run it with ``pdserve serve ray --config app.yaml``, or
``serve run services.ray.builder:build_pdserve_app transfer=grpc``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from services.ray.address_book import AddressBookDeployment
from services.ray.args import PdserveServingArgs
from services.ray.router import RouterIngress
from services.ray.workers import DecodeReplica, KVStoreReplica, PrefillReplica

# Requests one router replica takes at once (each is a proxied stream; the pdserve router
# behind it queues and sheds load itself).
ROUTER_MAX_ONGOING = 256


def build_pdserve_app(args: dict[str, Any] | str | Path | PdserveServingArgs) -> Application:
    """The application for ``serve.run``; ``args`` is a PdserveServingArgs, its dict form, or
    the path of a YAML file with it. Raises ValueError for bad args (before anything starts)."""
    if not isinstance(args, PdserveServingArgs):
        args = PdserveServingArgs.from_dict(args)
    book = AddressBookDeployment.bind()
    prefill = serve.deployment(PrefillReplica, name="Prefill").options(
        **args.prefill.deployment_options())
    decode = serve.deployment(DecodeReplica, name="Decode").options(
        **args.decode.deployment_options())
    router = serve.deployment(RouterIngress, name="Router", max_ongoing_requests=ROUTER_MAX_ONGOING
                              ).options(**args.router.deployment_options())
    # Bound but not called by the router: binding makes Serve run the worker deployments as
    # part of this application; the router reaches their services over gRPC.
    workers = [prefill.bind(args, book), decode.bind(args, book)]
    if args.kvstore is not None:
        kvstore = serve.deployment(KVStoreReplica, name="KVStore", max_replicas_per_node=1
                                   ).options(**args.kvstore.deployment_options())
        workers.append(kvstore.bind(args, book))
    return router.bind(args, book, *workers)
