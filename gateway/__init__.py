"""The Tandem gateway: the public tandem.v1.Tandem gRPC service. Admits requests into priority
tiers, routes them to prefill and decode workers, and streams the output to clients.

Process: `tandem gateway` (entrypoints/gateway.py); in-process: gateway.server.Gateway.
"""
