"""The HTTP routers beside the OpenAI routes: admin, batch and files, passthrough, the status page."""
