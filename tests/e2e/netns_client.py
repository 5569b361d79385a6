"""Client side of the partition test, run inside namespace B (`ip netns exec`): the router and the
decode node listen on B's addresses, which the test process cannot reach. Prints "SENDING" when its
requests are about to go out, then one JSON line with what came back and when.

    python -m tests.e2e.netns_client stream BASE_URL N PROMPT MAX_TOKENS
    python -m tests.e2e.netns_client generate DECODE SECRET PREFILL[,PREFILL] MAX_TOKENS
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def stream(base: str, n: int, prompt: str, max_tokens: int) -> list[dict]:
    import httpx

    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}

    async def one(client: httpx.AsyncClient) -> dict:
        start, first, text = time.monotonic(), None, ""
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text += "".join(c.get("text", "") for c in chunk.get("choices", []))
                    if first is None and text:
                        first = time.monotonic() - start
        return {"status": r.status_code, "first_token_s": first, "text": text}

    async with httpx.AsyncClient(timeout=120) as client:
        await client.get(f"{base}/health")  # connect and import everything before the clock starts
        print("SENDING", flush=True)
        return await asyncio.gather(*[one(client) for _ in range(n)])


async def generate(decode: str, secret: str, prefills: str, max_tokens: int) -> list[dict]:
    from tests.e2e.grpc_client import generate as grpc_generate, greedy

    print("SENDING", flush=True)
    start = time.monotonic()
    tokens, _ = await grpc_generate(decode, secret, "direct", [5, 6, 7, 8], greedy(max_tokens), prefills.split(","))
    return [{"tokens": tokens, "seconds": time.monotonic() - start}]


def main(argv: list[str]) -> None:
    mode, *args = argv
    if mode == "stream":
        result = asyncio.run(stream(args[0], int(args[1]), args[2], int(args[3])))
    else:
        result = asyncio.run(generate(args[0], args[1], args[2], int(args[3])))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
