"""The online retrieval service (FastAPI on uvicorn) and its load-test client."""
