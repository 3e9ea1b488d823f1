"""User-facing entry points (CLI now; REST, OpenAI-compatible API and web chat with their issue)."""
