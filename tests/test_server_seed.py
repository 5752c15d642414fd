"""--random-seed on the real server: a restarted server with the same seed draws the same
tokens for a request without a seed; another seed draws other tokens."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
from conftest import ServerHandle, launch_server, wait_healthy

# One request, one sample: every step draws one uniform, whatever the timing.
REQUEST = {
    "text": "Once upon a time",
    "sampling_params": {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True},
    "return_logprob": True,
}


def start(model_dir: Path, log_dir: Path, seed: int) -> ServerHandle:
    return launch_server(
        model_dir, log_dir, "--max-total-tokens", "256", "--random-seed", str(seed), wait=False
    )


def first_output(h: ServerHandle) -> tuple[list[int], float]:
    """The server's first request: its tokens and log P of drawing exactly them (the sum of
    their logprobs: temperature 1, no filters); then a clean stop."""
    wait_healthy(h)
    with h.client() as c:
        r = c.post("/generate", json=REQUEST)
    assert r.status_code == 200, r.text
    out = r.json()
    assert h.stop() == 0, h.log_text()[-4000:]
    return out["output_ids"], sum(e[0] for e in out["meta_info"]["output_token_logprobs"])


@pytest.mark.slow  # two rounds of server start-up: ~40 s on the 2-core dev machine
def test_same_random_seed_same_tokens_after_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    servers = [start(tiny_model_dir, tmp_path, 7), start(tiny_model_dir, tmp_path, 8)]
    try:
        tokens, log_p = first_output(servers[0])
        other, _ = first_output(servers[1])
        servers.append(start(tiny_model_dir, tmp_path, 7))  # the restart
        again, _ = first_output(servers[2])
    finally:
        for h in servers:
            if h.proc.poll() is None:
                h.stop(signal.SIGKILL)
    assert again == tokens
    # Seed 8 drawing these tokens too has probability exp(log_p).
    assert log_p < math.log(1e-9), f"draws too predictable for the test: log P {log_p:.1f}"
    assert other != tokens
