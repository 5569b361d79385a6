"""Generated protobuf/gRPC code for proto/pdserve/v1 (run `make proto`; do not edit)."""
