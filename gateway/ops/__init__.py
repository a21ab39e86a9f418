"""What operators see: Prometheus metrics, logs, the access log, tracing, the status history."""
