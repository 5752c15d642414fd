"""radixserve on Ray Serve, on a REAL local Ray cluster (slow; needs the `ray` extra, which
.ci/run installs for the slow tests): a head node and two worker nodes on loopback addresses,
one CPU each on the workers, two replicas of a tiny model, requests through Ray Serve's HTTP
proxy with the openai client and plain HTTP; a replica killed under load; 1 -> 2 -> 1
replicas, and 1 -> 2 -> 1 by Ray's autoscaling under load; two nodes' replicas sharing K/V
through a real redis-server. Nothing is mocked.
`ray stop --force` ends every Ray process of the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port, poll_until

HEAD_IP = "127.0.0.2"
WORKER_IPS = ("127.0.0.3", "127.0.0.4")
SERVE_ARGS = ("--max-total-tokens", "4096", "--dtype", "float32")
SYSTEM = "You answer questions about ships and the sea, briefly and kindly. " * 6


def _ray(*args: str) -> None:
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), *args], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A head (no CPUs: the controller, the proxy and the ingress) and two one-CPU worker
    nodes, each its own raylet on its own loopback address; the driver is this process."""
    import ray

    temp = Path(f"/tmp/rs-ray-{os.getpid()}")  # Ray's socket paths must stay short
    port = free_port()
    address = f"{HEAD_IP}:{port}"
    common = ("--disable-usage-stats", "--include-dashboard", "false")
    _ray("start", "--head", "--node-ip-address", HEAD_IP, "--port", str(port),
         "--num-cpus", "0", "--temp-dir", str(temp), *common[:1])  # fmt: skip
    try:
        for ip in WORKER_IPS:
            _ray("start", "--address", address, "--node-ip-address", ip, "--num-cpus", "1",
                 "--resources", json.dumps({f"node-{ip}": 1}), *common[:1])  # fmt: skip
        ray.init(address=address, logging_level="WARNING")
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _ray("stop", "--force")
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def proxy_url(cluster: str, tiny_model_dir: Path) -> Iterator[str]:
    from ray import serve

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": HEAD_IP, "port": port})
    deploy(tiny_model_dir, 2)
    yield f"http://{HEAD_IP}:{port}"
    serve.shutdown()


def deploy(model_dir: Path, replicas: int, *flags: str, **more: Any) -> None:
    """The app with `replicas` replicas of `radixserve serve` given SERVE_ARGS and `flags`;
    `more`: other RayServeOptions."""
    from ray import serve

    from radixserve.ray.app import RayServeOptions, application

    options = RayServeOptions(
        model=str(model_dir), serve_args=(*SERVE_ARGS, *flags), num_replicas=replicas,
        stats_period_s=0.5, **more,
    )  # fmt: skip
    serve.run(application(options), name=options.name, route_prefix="/")


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications["radixserve"]
    return app.deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def generate(url: str, text: str, **sampling: object) -> dict:
    params = {"max_new_tokens": 4, "temperature": 0, **sampling}
    resp = httpx.post(url + "/generate", json={"text": text, "sampling_params": params},
                      timeout=120)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow  # a Ray cluster and two replicas, once for the module (~5 min on 2 shared cores)
def test_routes_through_ray_proxy(proxy_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=proxy_url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, max_tokens=5, temperature=0, stream=True
    ))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content  # greedy both times
    done = client.completions.create(model="m", prompt="The sea", max_tokens=3)
    assert done.usage.completion_tokens == 3
    out = generate(proxy_url, "The sea")
    assert out["meta_info"]["completion_tokens"] == 4
    with httpx.stream("POST", proxy_url + "/generate", json={
        "text": "The sea", "stream": True, "sampling_params": {"max_new_tokens": 3}
    }, timeout=120) as resp:  # fmt: skip
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert httpx.get(proxy_url + "/v1/models", timeout=60).status_code == 200


@pytest.mark.slow
def test_bad_input_is_a_4xx_naming_the_field(proxy_url: str) -> None:
    bad = httpx.post(proxy_url + "/generate", content=b"{not json", timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    resp = httpx.post(proxy_url + "/v1/chat/completions", json={"model": "m"}, timeout=60)
    assert resp.status_code == 400 and "messages" in resp.json()["error"]["message"]
    resp = httpx.post(proxy_url + "/generate", timeout=60, json={
        "text": "x", "sampling_params": {"temperature": -1}
    })  # fmt: skip
    assert resp.status_code == 400 and "temperature" in resp.text


@pytest.mark.slow
def test_prompts_sharing_a_prefix_hit_the_cache(proxy_url: str) -> None:
    """Each group's first request lands somewhere; the router then sends the group where
    the prefix is cached, so every later request reuses the prefix."""
    for group in ("Fleet", "Harbour", "Lighthouse"):
        prefix = f"{group} log. {SYSTEM}"
        first = generate(proxy_url, prefix + " Question 0?")
        assert first["meta_info"]["cached_tokens"] < first["meta_info"]["prompt_tokens"]
        for i in range(1, 4):
            meta = generate(proxy_url, prefix + f" Question {i}?")["meta_info"]
            assert meta["cached_tokens"] >= meta["prompt_tokens"] - 16, (group, i, meta)


@pytest.mark.slow
def test_a_replica_killed_under_load(proxy_url: str) -> None:
    """Streams on the killed replica (`/generate`, chat and completions) are continued on
    the other one from the tokens they sent, non-streamed requests are answered (sent again
    where needed), and later requests succeed: no request fails."""
    import ray
    from ray.util.state import list_actors

    started: list[int] = []  # the streams that have their first event
    openai = {"max_tokens": 200, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    routes = [
        ("/generate", lambda text: {"text": text, "stream": True, "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}}),
        ("/v1/chat/completions", lambda text: {
            "messages": [{"role": "user", "content": text}], **openai}),
        ("/v1/completions", lambda text: {"prompt": text, **openai}),
    ]  # fmt: skip

    def stream(i: int) -> list[str]:
        path, body = routes[i % 3][0], routes[i % 3][1](f"Voyage {i}: {SYSTEM}")
        events = []
        with httpx.stream("POST", proxy_url + path, json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 1:
                        started.append(i)
        return events

    def plain(i: int) -> int:
        body = {"text": f"Cargo {i}", "sampling_params": {"max_new_tokens": 40}}
        return httpx.post(proxy_url + "/generate", json=body, timeout=120).status_code

    victims = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
               if "EngineReplica" in a.class_name]  # fmt: skip
    assert len(victims) == 2, victims
    with ThreadPoolExecutor(10) as pool:
        streams = [pool.submit(stream, i) for i in range(6)]
        plains = [pool.submit(plain, i) for i in range(4)]
        poll_until(lambda: len(started) == 6, 120, lambda: f"streams started: {started}")
        ray.kill(ray.get_actor(victims[0].name, namespace="serve"), no_restart=True)
        ended = [f.result() for f in streams]
        statuses = [f.result() for f in plains]
    assert statuses == [200] * 4
    for i, events in enumerate(ended):
        assert events[-1] == "data: [DONE]"
        assert not [e for e in events if '"error"' in e], events[-3:]
        data = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        if i % 3 == 0:  # /generate: cumulative events
            last = data[-1]
            assert len(last["output_ids"]) == last["meta_info"]["completion_tokens"] == 200
            texts = [d["text"] for d in data]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "the text went back"
        else:  # OpenAI chunks: one id and object throughout, the whole usage at the end
            assert len({(d["id"], d["object"]) for d in data}) == 1, data[0]
            assert data[-1]["usage"]["completion_tokens"] == 200 and not data[-1]["choices"]
            assert data[-2]["choices"][0]["finish_reason"] == "length"
            assert all("token_ids" not in d["choices"][0] for d in data[:-1])
    assert generate(proxy_url, "After the storm")["meta_info"]["completion_tokens"] == 4
    poll_until(lambda: running_replicas() == 2, 180, "Ray replaced the killed replica")


@pytest.mark.slow
def test_scale_one_two_one(proxy_url: str, tiny_model_dir: Path) -> None:
    for replicas in (1, 2, 1):
        deploy(tiny_model_dir, replicas)  # serve.run waits for the replicas
        assert running_replicas() == replicas
        assert generate(proxy_url, f"{replicas} ships")["meta_info"]["completion_tokens"] == 4


@pytest.mark.slow
def test_autoscaled_to_two_under_load_and_back(proxy_url: str, tiny_model_dir: Path) -> None:
    """Ray scales the replicas on their queues (1 to 2, a target of one request in flight
    each, short delays): requests kept in flight bring the second replica, which goes once
    they stop. Every request is answered."""
    scaling = {
        "max_replicas": 2,
        "target_ongoing_requests": 1.0,
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 5.0,
        "look_back_period_s": 2.0,
    }
    stop = threading.Event()

    def load(i: int) -> list[int]:
        codes = []
        while not stop.is_set():
            body = {"text": f"Tide table {i}", "sampling_params": {"max_new_tokens": 32}}
            codes.append(httpx.post(proxy_url + "/generate", json=body, timeout=120).status_code)
        return codes

    try:
        deploy(tiny_model_dir, 1, **scaling)
        assert running_replicas() == 1
        with ThreadPoolExecutor(6) as pool:
            loads = [pool.submit(load, i) for i in range(6)]
            try:
                poll_until(lambda: running_replicas() == 2, 240, "a second replica under load")
            finally:
                stop.set()
            codes = [c for f in loads for c in f.result()]
        assert codes and set(codes) == {200}, codes
        poll_until(lambda: running_replicas() == 1, 240, "back to one replica once idle")
    finally:
        deploy(tiny_model_dir, 2)  # the module's other tests' replicas


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_conversation_resumes_from_the_redis_tier_on_another_node(
    proxy_url: str, tiny_model_dir: Path
) -> None:
    """Two replicas, one on each worker node, write their K/V through to one Redis. The
    replica that served a prompt is killed; the same prompt, sent at once, is served by the
    replica on the other node (the killed one's replacement is not up yet), which reads the
    prompt's K/V from Redis instead of computing it. The replica that served it is found by
    killing one: if the survivor had the prompt itself, it is killed in turn once Ray has
    replaced the first."""
    import ray
    from ray.util.state import list_actors
    from test_hicache_redis import RedisServer, wait_records

    from radixserve.kvcache.tier_store import CHUNK_TOKENS

    redis_server = RedisServer(free_port())
    try:
        secret = ("--hicache-secret", "the replicas' shared tier secret")
        deploy(tiny_model_dir, 2, "--hicache-remote", redis_server.url, *secret)
        prompt = "Ships of the Baltic. " + SYSTEM
        first = generate(proxy_url, prompt)["meta_info"]
        wait_records(redis_server.client(), first["prompt_tokens"] // CHUNK_TOKENS)

        def replicas() -> list[str]:
            alive = list_actors(filters=[("state", "=", "ALIVE")])
            return [a.name for a in alive if "EngineReplica" in a.class_name]

        for victim in replicas():  # one of the two served the prompt
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            meta = generate(proxy_url, prompt)["meta_info"]
            if meta["cached_tokens_details"].get("remote", 0) > 0:
                break  # the other replica, on the other node, read it from Redis
            assert meta["cached_tokens"] >= first["prompt_tokens"] - 16, meta  # its own
            poll_until(lambda: running_replicas() == 2, 180, "Ray replaced the killed replica")
        else:
            pytest.fail(f"no replica read the prompt from Redis: {meta}")
        prefilled = meta["prompt_tokens"] - meta["cached_tokens"]
        assert prefilled < CHUNK_TOKENS, meta  # the prompt's whole chunks came from the tier
    finally:
        deploy(tiny_model_dir, 2)  # the module's other tests' replicas
        redis_server.stop()
