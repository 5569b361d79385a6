"""Decode node: holds the KV cache, has prefill nodes fill it, generates with continuous batching."""

from pdserve.decode_node.server import DecodeNode

__all__ = ["DecodeNode"]
