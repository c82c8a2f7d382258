"""Code shared by the prefill, decode and role-both worker processes.

The engine thread and its command queue (`worker.engine_loop`), the stats snapshot, KV-event
fan-out, Prometheus metrics, proto adapters common to both worker services, and the server
bootstrap with health, reflection and graceful drain (`worker.server`).
"""
