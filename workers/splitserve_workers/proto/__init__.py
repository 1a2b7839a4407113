"""Generated gRPC stubs for protos/splitserve/v1 (hack/gen-protos.sh writes them; do not edit)."""
