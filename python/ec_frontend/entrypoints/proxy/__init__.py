"""``ec-frontend proxy``: the E -> P -> D orchestrator (``app``), its flags (``cli``) and
its metrics. It speaks HTTP to instances and imports neither the engine nor the OpenAI
server."""
