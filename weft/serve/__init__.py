"""The OpenAI-compatible server: `weft serve` (api_server), its engine thread, protocol and metrics."""
