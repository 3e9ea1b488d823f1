"""The HTTP surface: the Starlette app, request bodies and their validation, errors in the
OpenAI shape, the OpenAPI document, the websocket chat and /metrics (the routes themselves
are frontend/routes/, the OpenAI API's frontend/openai/)."""
