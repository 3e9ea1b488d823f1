"""The HTTP routes, one module per area (system, OpenAI API, adapters, admin, websocket chat).
Each module lists its Endpoints (module-level handlers that find the server's state on the
app: endpoint.server); the app builds its routes and the OpenAPI document from them."""
