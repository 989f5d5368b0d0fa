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

import hashlib
import importlib.metadata
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
    replica_args = args.for_replicas()
    version = code_version(replica_args)
    book = versioned(AddressBookDeployment, version).bind()
    prefill = versioned(serve.deployment(PrefillReplica, name="Prefill"), version).options(
        **args.prefill.deployment_options())
    decode = versioned(serve.deployment(DecodeReplica, name="Decode"), version).options(
        **args.decode.deployment_options())
    router = versioned(serve.deployment(RouterIngress, name="Router",
                                        max_ongoing_requests=ROUTER_MAX_ONGOING), version
                       ).options(**args.router.deployment_options())
    # Bound but not called by the router: binding makes Serve run the worker deployments as
    # part of this application; the router reaches their services over gRPC.
    workers = [prefill.bind(replica_args, book), decode.bind(replica_args, book)]
    if args.kvstore is not None:
        kvstore = versioned(serve.deployment(KVStoreReplica, name="KVStore",
                                             max_replicas_per_node=1), version
                            ).options(**args.kvstore.deployment_options())
        workers.append(kvstore.bind(replica_args, book))
    app: Application = router.bind(replica_args, book, *workers)
    return app


def code_version(replica_args: PdserveServingArgs) -> str:
    """A version that changes with the replicas' args and pdserve's version, not with scale
    (as Serve's own config deploys version by import path and args): re-running the app with
    only ``num_replicas`` changed adds or removes replicas in place."""
    digest = hashlib.sha256(repr(replica_args).encode())
    try:
        digest.update(importlib.metadata.version("pdserve").encode())
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        pass
    return digest.hexdigest()[:16]


def versioned(deployment: Any, version: str) -> Any:
    """``deployment`` with a fixed code version. Serve gives an unversioned deployment a random
    one on every ``serve.run`` (so every run restarts every replica) and no longer takes
    ``version`` from users; its internal flag is the only way left (checked on Ray 2.60)."""
    return deployment.options(version=version, _internal=True)
