"""pdserve: disaggregated prefill/decode LLM serving (CLI package; generated protos live in pdserve.v1)."""

__version__ = "0.1.0"
