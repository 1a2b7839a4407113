"""splitserve workers: the PyTorch engine, prefill/decode/colocated gRPC workers, the router
and local mode. The operator (in ../operator) shares only `config` with this package."""

__version__ = "0.1.0"
