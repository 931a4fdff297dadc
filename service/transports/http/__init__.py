"""The HTTP transport: the FastAPI app and its route groups (tensors, files, Hub-compatible,
the browser), the URL layout and the API docs pages."""
