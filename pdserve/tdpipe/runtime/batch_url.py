"""http(s) input and output for `pdserve batch`, as vLLM's run-batch takes them.

The input is downloaded with a GET into an anonymous temporary file (in pieces, never held whole in
memory), then read from there line by line: a job may pause reading for minutes while its window is
full, which an HTTP server would take for a dead client. The output is written to
a local file first, with the lock, per-line flushing and `--resume` of a local output; when the
job ends it is uploaded with a PUT, retried with backoff. The local file's name derives from the
URL, so a `--resume` of an interrupted job finds what it had written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import BinaryIO

UPLOAD_ATTEMPTS = 5
HTTP_TIMEOUT_S = 60.0


def is_url(name: str) -> bool:
    return name.startswith(("http://", "https://"))


def open_input(name: str) -> BinaryIO:
    """The input as a binary stream: the file, or the body of a GET spooled to a temporary file
    (OSError when unreachable or answered with an error status, with the URL in the message)."""
    if not is_url(name):
        return open(name, "rb")
    spool = tempfile.TemporaryFile()  # removed when closed, or when the process dies
    try:
        with urllib.request.urlopen(urllib.request.Request(name, method="GET"), timeout=HTTP_TIMEOUT_S) as resp:
            shutil.copyfileobj(resp, spool, 1 << 20)
    except urllib.error.HTTPError as e:
        spool.close()
        raise OSError(f"GET {name}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        spool.close()
        raise OSError(f"GET {name}: {getattr(e, 'reason', e)}") from None
    spool.seek(0)
    return spool


def local_output(name: str, local_dir: str | None = None) -> str:
    """Where the job writes its output: `name` itself, or for a URL a file named after it in
    `local_dir` (default: the temp directory), the same for every run so that --resume finds it."""
    if not is_url(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return os.path.join(local_dir or tempfile.gettempdir(), f"pdserve-batch-{digest}.jsonl")


def upload(path: str, url: str, attempts: int = UPLOAD_ATTEMPTS, backoff_s: float = 1.0) -> None:
    """PUT the file at `path` to `url`; retried on connection errors and 5xx/429 answers with
    exponential backoff. OSError naming the URL and the last failure when every attempt failed."""
    size = os.path.getsize(path)
    why = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            with open(path, "rb") as f:
                req = urllib.request.Request(
                    url,
                    data=f,
                    method="PUT",
                    headers={"Content-Type": "application/jsonl", "Content-Length": str(size)},
                )
                with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
                    resp.read()
            return
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code} {e.reason}"
            if e.code < 500 and e.code != 429:  # the server refused the upload itself: retrying cannot help
                break
        except (urllib.error.URLError, OSError) as e:
            why = str(getattr(e, "reason", e))
        print(f"upload to {url} failed (attempt {attempt + 1}/{attempts}): {why}", file=sys.stderr)
    raise OSError(f"PUT {url}: {why}; the results stay in {path}")
