"""Block keys are stable across processes and separate namespaces."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.engine.block_keys import block_key, namespace_root, prompt_block_keys

_PRINT_KEYS = (
    "from pdserve.engine.block_keys import namespace_root, prompt_block_keys;"
    "print(prompt_block_keys(namespace_root('model=m;dtype=float32', 'tenant-a'), list(range(50)), 16))"
)


def test_keys_equal_across_processes_with_different_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _PRINT_KEYS], env=env, capture_output=True, text=True, check=True)
        outputs.add(out.stdout.strip())
    assert len(outputs) == 1
    here = prompt_block_keys(namespace_root("model=m;dtype=float32", "tenant-a"), list(range(50)), 16)
    assert outputs == {str(here)}


def test_chain_depends_on_every_earlier_token_and_the_namespace() -> None:
    root = namespace_root("model=m", None)
    a = prompt_block_keys(root, list(range(48)), 16)
    assert len(a) == 3 and len(set(a)) == 3
    changed = list(range(48))
    changed[0] = 999
    b = prompt_block_keys(root, changed, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert prompt_block_keys(namespace_root("model=m", ""), list(range(48)), 16)[0] != a[0]
    assert prompt_block_keys(namespace_root("model=m", "s"), list(range(48)), 16)[0] != a[0]
    assert prompt_block_keys(namespace_root("model=other", None), list(range(48)), 16)[0] != a[0]
    assert prompt_block_keys(root, list(range(48)), 16, limit=2) == a[:2]
    assert block_key(root, list(range(16))) == a[0]
    assert all(0 <= k < 2**64 for k in a)
