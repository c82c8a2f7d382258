"""The gateway's OpenAI-compatible HTTP API: FastAPI app and uvicorn server (app.py), the
OpenAI bodies (schemas.py), request/response adapters (adapters.py), SSE (sse.py) and the
error body (errors.py). A thin adapter onto gateway.admission, like the proto adapters."""
