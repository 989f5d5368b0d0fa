"""Every gRPC channel pdserve opens comes from here, so each one carries the cluster's
credentials (services/common/internal_auth.py) without its caller knowing which.

    channel = internal_channel("127.0.0.1:50061", options=[...])       # grpc.aio, on the loop
    with internal_sync_channel(address) as channel: ...               # blocking
    with public_channel(router_address, api_key=key) as channel: ...  # a router's public API

An internal channel is TLS with this process's certificate when mTLS is configured (the
server's certificate is checked against ``--tls-ca``; the address's host must be in its SANs),
plaintext otherwise; with an internal token each call carries it as metadata. A public channel
is plaintext (terminate TLS for clients in front of the router) and, given a key, sends
``authorization: Bearer <key>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from services.common import internal_auth
from services.common.grpc_auth import SyncTokenInterceptor, token_interceptors
from services.common.internal_auth import TOKEN_METADATA, InternalAuth

Options = Sequence[tuple[str, Any]]


def channel_credentials(auth: InternalAuth) -> grpc.ChannelCredentials | None:
    """Client-side mTLS credentials, or None for plaintext."""
    if auth.tls is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=auth.tls.root_ca,
                                        private_key=auth.tls.private_key,
                                        certificate_chain=auth.tls.cert_chain)


def server_credentials(auth: InternalAuth) -> grpc.ServerCredentials | None:
    """Server-side mTLS credentials requiring a CA-signed client certificate, or None."""
    if auth.tls is None:
        return None
    return grpc.ssl_server_credentials([(auth.tls.private_key, auth.tls.cert_chain)],
                                       root_certificates=auth.tls.root_ca,
                                       require_client_auth=True)


def internal_channel(address: str, options: Options = (),
                     auth: InternalAuth | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to another pdserve service (bind it to the loop that uses it)."""
    auth = internal_auth.current() if auth is None else auth
    interceptors = token_interceptors(TOKEN_METADATA, auth.token) if auth.token else None
    credentials = channel_credentials(auth)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=list(options),
                                   interceptors=interceptors)


def internal_sync_channel(address: str, options: Options = (),
                          auth: InternalAuth | None = None) -> grpc.Channel:
    """A blocking channel to another pdserve service."""
    auth = internal_auth.current() if auth is None else auth
    credentials = channel_credentials(auth)
    channel = (grpc.insecure_channel(address, options=list(options)) if credentials is None
               else grpc.secure_channel(address, credentials, options=list(options)))
    if auth.token:
        return grpc.intercept_channel(channel, SyncTokenInterceptor(TOKEN_METADATA, auth.token))
    return channel


def public_channel(address: str, api_key: str = "", options: Options = ()) -> grpc.Channel:
    """A blocking plaintext channel to a router's public gRPC API, sending ``api_key``."""
    channel = grpc.insecure_channel(address, options=list(options))
    if api_key:
        return grpc.intercept_channel(channel, SyncTokenInterceptor("authorization", f"Bearer {api_key}"))
    return channel


def public_aio_channel(address: str, api_key: str = "", options: Options = ()) -> grpc.aio.Channel:
    """The grpc.aio twin of ``public_channel``."""
    interceptors = token_interceptors("authorization", f"Bearer {api_key}") if api_key else None
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
