"""The node's HTTP API: JSON status documents, the OpenAI-compatible ``/v1`` routes, and their client."""
