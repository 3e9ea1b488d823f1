"""User-facing entry points: tenants and adapter uploads (REST), the OpenAI-compatible API, the
streaming websocket chat and its page, /metrics, and the CLI (serve, prepare, admin)."""
