"""Who may talk to pdserve: API keys for the public API (`apikeys`), TLS credentials for
every gRPC channel (`tls`), a development certificate authority (`certs`), and the gRPC
interceptor that refuses unauthenticated calls (`interceptors`). docs/security.md says
which channel is protected how."""
