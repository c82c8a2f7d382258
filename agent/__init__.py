"""The infra agent (`tandem agent`): its own process that watches every worker's health and
Prometheus metrics, confirms anomalies with warn/act thresholds held through a window, and
drains, restarts or isolates a worker through the gateway's Admin RPCs and the launcher's
supervisor. Pure decision logic (confirm.py, signals.py, policy.py) is separate from the I/O
(sources.py, actions.py) and the loop (main.py). Torch-free; imports `tandem` and `kvindex` only."""
