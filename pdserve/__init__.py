"""pdserve: disaggregated prefill/decode LLM serving.

One namespace, read top-down (docs/architecture.md, "Floors"):

- the app: `pdserve.cli` and `pdserve.commands` (the `pdserve` command);
- services: `pdserve.router`, `pdserve.prefill_node`, `pdserve.decode_node`, `pdserve.tdpipe`;
- shared layers: `pdserve.openai_api`, `pdserve.node_runtime`;
- ground: `pdserve.engine`, `pdserve.cachestore`, and the generated wire code `pdserve.v1`.

This module holds only the product version, so that every floor may read it without importing
another floor.
"""

__version__ = "0.1.0"
