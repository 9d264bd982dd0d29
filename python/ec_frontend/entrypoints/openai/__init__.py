"""The OpenAI-compatible server: the FastAPI app (``server``), the endpoint-independent
request core (``serving``) and one module per endpoint family's wire format. It talks to
an engine through the engine layer's client interface and never imports the proxy or
the launcher."""
