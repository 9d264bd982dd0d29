"""HTTP plumbing shared by the OpenAI server and the proxy: OpenAI-shaped errors,
the ASGI middleware (request ids, drain, auth, metrics) and uvicorn's protocol with
the limits it lacks. It imports nothing above the engine."""
