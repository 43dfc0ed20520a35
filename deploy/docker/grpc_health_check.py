#!/usr/bin/env python3
"""gRPC health probe for the container HEALTHCHECK (and anyone without grpc_health_probe).

    python grpc_health_check.py [ADDRESS] [--service NAME] [--timeout S]

Exit 0 when `grpc.health.v1.Health/Check` answers SERVING, 1 otherwise (NOT_SERVING while
the server drains, connection refused while the model loads, unknown service, timeout).
ADDRESS defaults to 127.0.0.1:$LIVESPEECH_PORT (50051); the service defaults to the
LiveSpeech service, so a draining server reports unhealthy. Kubernetes uses its native
gRPC probe instead (deploy/base/deployment.yaml).
"""
from __future__ import annotations

import argparse
import os
import sys

SERVICE = "livespeech.v1.LiveSpeech"


def check(address: str, service: str = SERVICE, timeout: float = 3.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("address", nargs="?", default=f"127.0.0.1:{os.environ.get('LIVESPEECH_PORT', '50051')}")
    p.add_argument("--service", default=SERVICE, help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args(argv)
    ok, status = check(args.address, args.service, args.timeout)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
