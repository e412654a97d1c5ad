"""Prefill and decode workers: the engine with its KV connector role, the gRPC
services of both roles, and how a worker is served and registered."""
