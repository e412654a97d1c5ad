"""How every pdserve process serves and dials gRPC: `settings` (the server's, the public
API's and the internal settings), `grpc_server` (a server with health, reflection,
metrics and a graceful stop), `listener` (how its port is secured and its
interceptors), `ports` (TLS and mTLS on ports), `errors` (the interceptor that turns
exceptions into statuses), `auth` (the API key interceptor), `handlers` (what
interceptors rebuild handlers with) and `channels` (`dial`, the shared gRPC options,
loopback helpers)."""
