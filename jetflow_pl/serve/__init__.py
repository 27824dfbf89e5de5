"""`jetflow-serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the batched `DecodeEngine`.

* `driver.EngineDriver`: the one background thread that owns the model and steps the engine; handlers
  talk to it through thread-safe queues (no model call on the event loop);
* `app.create_app(driver, tokenizer, ServeConfig(...))`: `/v1/completions`, `/v1/chat/completions`
  (SSE streaming), `/v1/models`, `/health`, `/metrics`;
* `faults.FaultGuard`: a request whose outputs turn NaN fails alone, the batch goes on;
* `text.TextStream`: incremental detokenization and `stop` strings;
* `cli`: the `jetflow-serve` command (docs/SERVING.md).

Needs the `serve` extra (`pip install 'jetflow-pl[serve]'`: fastapi, uvicorn, prometheus-client).
"""
