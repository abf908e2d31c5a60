"""Hub-side wiring: the demo authenticator, status pages, and config helpers."""
