"""The web console in a real browser: headless Chromium (Debian's `chromium` package) driven
by Playwright, against a live server on the embedded model. A chat reply streams in, a fork
of 4 shows side by side, and the cache view draws the fork's prompt as one node with four
children; the page requests nothing outside the server. Screenshots of each view are written
to $RADIXSERVE_SCREENSHOTS (docs/ when refreshing docs/serving.md's pictures), else a temp
dir."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import API_KEY, ServerHandle, launch_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [  # no sandbox as root; no background calls to outside hosts
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 120_000

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM),
        reason="needs Chromium: apt-get install -y chromium (.ci/run installs it)",
    ),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    h = launch_server(
        None,
        tmp_path_factory.mktemp("console-server"),
        "--max-total-tokens",
        "4096",
        api_key=API_KEY,
        dtype="auto",
    )
    yield h
    assert h.stop() == 0, h.log_text()[-4000:]


def test_chat_fork_and_tree_in_chromium(live: ServerHandle, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("RADIXSERVE_SCREENSHOTS", tmp_path))
    outside: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.set_default_timeout(TIMEOUT_MS)
        page.on("request", lambda r: None if r.url.startswith(live.url) else outside.append(r.url))
        page.goto(f"{live.url}/?key={API_KEY}")

        page.fill("#input", "Name three colours of the rainbow.")
        page.click("#send")
        reply = page.locator(".msg.assistant.done span")
        reply.wait_for()
        assert reply.inner_text().strip(), "the assistant's reply is empty"
        page.screenshot(path=str(shots / "console_chat.png"))

        page.fill("#temperature", "1.5")
        page.fill("#seed", "7")
        page.fill("#max_tokens", "24")
        page.fill("#n", "4")
        page.fill("#input", "Now name an animal.")
        page.click("#fork")
        page.locator("#forks.done").wait_for()
        samples = page.locator(".fork span").all_inner_texts()
        assert len(samples) == 4 and all(s.strip() for s in samples), samples
        assert len(set(samples)) == 4, f"the four samples should differ: {samples}"
        page.screenshot(path=str(shots / "console_fork.png"))

        page.click("header button[data-tab=cache]")
        # The fork's prompt is one node whose four drawn children are the four samples.
        page.wait_for_function(
            """() => {
                const nodes = [...document.querySelectorAll('#treesvg g.node')];
                const kids = {};
                for (const n of nodes) kids[n.dataset.parent] = (kids[n.dataset.parent] || 0) + 1;
                return nodes.some((n) => kids[n.dataset.id] === 4 && n.dataset.children === '4');
            }"""
        )
        page.screenshot(path=str(shots / "console_cache.png"))
        page.click("header button[data-tab=plots]")
        page.wait_for_timeout(1500)
        page.screenshot(path=str(shots / "console_plots.png"))
        browser.close()
    assert not outside, f"the page requested outside the server: {outside}"
