"""Who may talk to pdserve: API keys for the public API (`apikeys`), TLS credentials for
every gRPC channel (`tls`), a development certificate authority (`certs`), and what a
process's settings allow (`policy`); `services/server/` applies them to its ports and
calls. docs/security.md says which channel is protected how."""
