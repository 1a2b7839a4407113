"""The OpenAI-compatible router: app.py (HTTP + `splitserve router`), openai_api.py (wire
format), flow.py (one request through the pools), picking.py (which worker), discovery.py (where
the workers are), detok.py (tokens to text). Holds the tokenizer only, never model weights."""
