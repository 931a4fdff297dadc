"""The HTTP transport: the FastAPI app (app.py) and its route groups (ops, tensors, files,
browser, Hub-compatible), the streaming response, middleware, URL layout and API docs pages."""
