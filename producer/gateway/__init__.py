"""``pagedq-gateway``: OpenAI's HTTP API (models, completions, chat completions, files,
batches) in front of pagedq's queues; install with the ``gateway`` extra. A ``model`` is a
queue. Nothing is imported here, so that the CLI can use ``schemas`` without FastAPI."""
