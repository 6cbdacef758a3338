"""HTTP edge: the FastAPI app, its routers, request/response schemas and the dashboard."""
