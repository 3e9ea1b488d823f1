"""The OpenAI-compatible API: its request bodies (protocol), the typed generation request they
become (generation), response bodies (responses) and the serving of the routes (serving)."""
