"""What the operator reads: the status (status.py: rows, verdicts from gpugate.match), who holds
the GPUs (holders.py), the Prometheus file (prometheus.py), the fleet-wide report callbacks
(fleet.py) and the text helpers they share (text.py)."""
