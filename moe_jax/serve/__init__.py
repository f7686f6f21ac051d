"""An OpenAI-compatible HTTP server over the generation engine (`moe_jax.inference.engine`):

    python -m moe_jax.serve RUN_DIR [--host 127.0.0.1] [--port 8000] [--max-slots 8]
        [--max-queue 256] [--page-size 16] [--pages N] [--chunk 64] [--step N] [overrides]

`app.py` holds the routes, `requests.py` turns OpenAI bodies into engine requests, `text.py`
the tokens into streamed text, `reply.py` the response objects, `worker.py` the engine's
thread. Needs the `serve` extra
(fastapi, uvicorn).
"""
