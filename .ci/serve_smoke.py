"""The installed `radixserve` command serves the embedded model and answers one request.

    python .ci/serve_smoke.py /path/to/venv/bin/radixserve

Run from outside the source tree with a venv holding the built wheel (not an editable
install), so that what is tested is what the wheel contains. Exits non-zero on failure.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

STARTUP_S = 600


def main(exe: str) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "serve", "--port", str(port), "--max-total-tokens", "4096"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                print(f"the server exited with {proc.returncode}")
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print(f"the server did not come up in {STARTUP_S} s")
                return 1
            time.sleep(0.5)
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
        r = httpx.post(url + "/generate", json=body, timeout=120)
        print(r.status_code, r.text[:300])
        ok = r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
        return 0 if ok else 1
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
