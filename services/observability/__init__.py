"""Observability: OpenTelemetry traces (`tracing`, `spans`) and the live fleet view
(`top`). Everything here is off unless asked for; with tracing off the span helpers
return one shared no-op object and nothing is exported."""
