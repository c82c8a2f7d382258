"""The Tandem gateway: the public tandem.v1.Tandem gRPC service. Admits requests into priority
tiers, routes them to prefill and decode workers, and streams the output to clients.

Entry point: `python -m gateway` (gateway.server.main); in-process: gateway.server.Gateway.
"""
