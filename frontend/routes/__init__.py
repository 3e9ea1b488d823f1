"""The HTTP routes, one module per area (system, OpenAI API, adapters, admin, websocket chat).
Each module lists its Endpoints; the app builds its routes and the OpenAPI document from them."""
