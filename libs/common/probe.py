"""A gRPC health probe for container health checks (compose, Kubernetes
exec probes): ``python -c "from libs.common.probe import main; main('127.0.0.1:7000')"``.
It takes the service's own TLS settings from its environment (FERRY_TLS_CERT,
FERRY_TLS_KEY, FERRY_TLS_CA, FERRY_TLS_SERVER_NAME), so that the check keeps
working when the cluster's gRPC runs over (mutual) TLS; a plain-text probe
of a TLS server failed and marked every service unhealthy. Health checks
need no cluster token."""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.common import rpc


def credentials_from_env(env=os.environ) -> rpc.Credentials:
    return rpc.load_credentials(tls_cert=env.get("FERRY_TLS_CERT", ""), tls_key=env.get("FERRY_TLS_KEY", ""),
                                tls_ca=env.get("FERRY_TLS_CA", ""),
                                tls_server_name=env.get("FERRY_TLS_SERVER_NAME", ""))


def serving(address: str, timeout_s: float = 3.0, credentials: rpc.Credentials | None = None) -> bool:
    try:
        with rpc.sync_channel(address, credentials or credentials_from_env()) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def main(address: str) -> None:
    """Exit 0 when the service at ``address`` is SERVING, else 1."""
    sys.exit(0 if serving(address) else 1)
