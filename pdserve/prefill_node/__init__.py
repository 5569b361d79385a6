"""Prefill node: computes prompts and streams each layer's KV into a decode node's pool."""

from pdserve.prefill_node.server import PrefillNode

__all__ = ["PrefillNode"]
