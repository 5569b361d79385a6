"""What one attempt of a request sends to its decode node: the router retries a request before its
first token and migrates it after, and each attempt continues from the tokens already sent."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.v1 import decode_pb2


def salt_of(request: decode_pb2.GenerateRequest) -> str | None:
    """The request's cache_salt; None when unset (the unsalted namespace)."""
    return request.cache_salt if request.HasField("cache_salt") else None


def attempt_request(
    request: decode_pb2.GenerateRequest,
    request_id: str,
    sent: list[int],
    prefills: list[str],
    prefill_cached: Sequence[int],
) -> decode_pb2.GenerateRequest:
    """What one attempt sends: `request` continued after the tokens already `sent` (they join the
    prompt and count against max_tokens and min_tokens; a grammar resumes after them), on its
    route's prefill nodes."""
    req = decode_pb2.GenerateRequest()
    req.CopyFrom(request)
    req.request_id = request_id
    req.prompt_token_ids.extend(sent)
    params = request.params
    req.params.max_tokens = params.max_tokens - len(sent)
    req.params.min_tokens = max(0, params.min_tokens - len(sent))
    if params.HasField("structured_outputs"):
        req.params.structured_outputs.generated_token_ids[:] = sent
    req.prefill_addresses[:] = prefills
    req.prefill_cached_tokens[:] = prefill_cached
    return req
