"""The installed `radixserve` command serves the embedded model and answers one request.

    python .ci/serve_smoke.py /path/to/venv/bin/radixserve

Run from outside the source tree with a venv holding the built wheel (not an editable
install), so that what is tested is what the wheel contains: the server must build its native
kernels from the wheel's sources (a kernel falling back to torch ops fails the check) and
answer. Exits non-zero on failure.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import httpx

STARTUP_S = 600
FALLBACK = "using torch ops"  # native_build's warning when a kernel does not build


def main(exe: str) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile("w+") as log:
        cmd = [exe, "serve", "--port", str(port), "--max-total-tokens", "4096"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            answered = serves(proc, f"http://127.0.0.1:{port}")
        finally:
            proc.terminate()
            proc.wait(60)
        log.seek(0)
        text = log.read()
    print(text[-4000:])
    if FALLBACK in text:
        print("a native kernel did not build from the wheel's sources")
        return 1
    return 0 if answered else 1


def serves(proc: subprocess.Popen[bytes], url: str) -> bool:
    """The server comes up and generates 8 tokens."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            print(f"the server exited with {proc.returncode}")
            return False
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            print(f"the server did not come up in {STARTUP_S} s")
            return False
        time.sleep(0.5)
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    print(r.status_code, r.text[:300])
    return r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
