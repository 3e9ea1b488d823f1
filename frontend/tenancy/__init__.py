"""Tenants and what they own: API keys and the admin token, the crash-consistent store of
tenants and adapters (SQLite and files), uploads, start-up recovery, per-tenant admission
limits, and whose cached prefixes a request may reuse."""
