"""The llama.cpp peer of ``kamera bench consistency``: its client against a stand-in server that
speaks llama-server's protocol, its summary, and (only where a binary was built) the real one."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from bench.peer_llama import (
    LlamaServer,
    Peer,
    PeerOutcome,
    PeerRow,
    PeerUnavailableError,
    build_flags,
    llama_server_binary,
    summarize_peer,
)

# A stand-in llama-server: /health, slot erase, and a streamed /completion whose answer is the
# prompt's last ids reversed; it keeps the last prompt (when cache_prompt) and reports the common
# prefix as timings.cache_n, as llama-server does with its slot.
FAKE = textwrap.dedent(
    """
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    last = []
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b'{"status":"ok"}')
        def do_POST(self):
            global last
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path.startswith("/slots/0?action=erase"):
                last = []
                self.send_response(200); self.end_headers(); self.wfile.write(b"{}"); return
            ids = body["prompt"]
            n = 0
            if body.get("cache_prompt") and "--no-cache-prompt" not in sys.argv:
                while n < min(len(ids), len(last)) - 0 and ids[n] == last[n]:
                    n += 1
                n = min(n, len(ids) - 1)
                last = list(ids)
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
            out = ids[::-1][: body["n_predict"]]
            for t in out:
                self.wfile.write(b"data: " + json.dumps({"content": "x", "tokens": [t]}).encode() + b"\\n\\n")
            end = {"content": "", "tokens": [], "stop": True,
                   "timings": {"cache_n": n, "prompt_n": len(ids) - n}}
            self.wfile.write(b"data: " + json.dumps(end).encode() + b"\\n\\n")
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    exe = tmp_path / "llama-server"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_client_reads_tokens_ttft_and_cache_n_from_the_stream(fake_binary: Path, tmp_path: Path) -> None:
    server = LlamaServer(fake_binary, tmp_path / "m.gguf", [], 1, 512, tmp_path / "log")
    try:
        first = server.complete([5, 6, 7, 8], 3, cache_prompt=True)
        assert first.tokens == [8, 7, 6]
        assert first.prompt_tokens == 4
        assert first.cached_tokens == 0
        assert first.ttft_s > 0
        again = server.complete([5, 6, 7, 9], 2, cache_prompt=True)
        assert again.cached_tokens == 3
        assert again.tokens == [9, 7]
        server.erase()
        assert server.complete([5, 6, 7, 9], 2, cache_prompt=True).cached_tokens == 0
    finally:
        server.close()


def test_peer_erases_the_slot_at_each_new_conversation(fake_binary: Path, tmp_path: Path) -> None:
    peer = Peer(fake_binary, tmp_path / "m.gguf", 16, 1, 512, tmp_path / "log")
    try:
        a = peer.request("s1", 0, [1, 2, 3, 4], 2)
        b = peer.request("s1", 1, [1, 2, 3, 4, 5], 2)
        c = peer.request("s2", 0, [1, 2, 3, 4, 5], 2)
    finally:
        peer.close()
    assert a.cached.cached_tokens == 0
    assert b.cached.cached_tokens == 4
    assert c.cached.cached_tokens == 0  # a new conversation starts from an erased slot
    assert b.reference.cached_tokens == 0  # the reference instance never caches
    assert a.cached.tokens == a.reference.tokens


def test_a_server_that_dies_at_start_is_reported(tmp_path: Path) -> None:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nkill -SEGV $$\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(PeerUnavailableError, match="exited with -11"):
        LlamaServer(exe, tmp_path / "m.gguf", [], 1, 512, tmp_path / "log")


def _row(cached: list[int], ref: list[int], hit: int, n: int, ttft: float) -> PeerRow:
    return PeerRow("s", 0, PeerOutcome(cached, ttft, n, hit), PeerOutcome(ref, 1.0, n, 0))


def test_summarize_peer_counts_agreement_shares_and_ttft_on_hits() -> None:
    rows = [
        _row([1, 2], [1, 2], 0, 100, 1.0),  # no hit
        _row([1, 2], [1, 2], 80, 100, 0.25),  # hit, same
        _row([1, 3], [1, 2], 50, 100, 0.5),  # hit, differs after the first token
        _row([4], [1, 2], 70, 100, 0.5),  # hit, differs from the first token
    ]
    s = summarize_peer(rows)
    assert s["requests"] == 4
    assert s["requests_with_hits"] == 3
    assert s["greedy_agreement_with_hits"] == round(1 / 3, 4)
    assert s["greedy_agreement"] == 0.5
    assert s["first_token_agreement"] == 0.75
    assert s["shares"]["cached"] == 0.5
    assert s["shares"]["recomputed"] == 0.5
    assert s["ttft_ratio_median"] == 2.0
    assert s["kl_mean"] is None
    assert s["shares"]["exact"] is None


def test_the_build_leaves_out_amx_on_x86_and_never_fetches_the_web_ui() -> None:
    import os

    flags = build_flags()
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in flags
    assert any("-mno-amx-tile" in f for f in flags) == (os.uname().machine == "x86_64")


def test_real_llama_server_agrees_with_itself_on_a_repeated_prompt(tmp_path: Path) -> None:
    """Only where a binary was built (``kamera bench consistency --peer llama-server`` builds it)."""
    try:
        binary = llama_server_binary(build=False)
    except PeerUnavailableError as e:
        pytest.skip(str(e))
    from agent.adapters.loading import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("no SmolLM2 GGUF installed")
    peer = Peer(binary, gguf, 16, 2, 2048, tmp_path / "log")
    try:
        ids = list(range(1000, 1300))
        first = peer.request("s", 0, ids, 6)
        again = peer.request("s", 1, ids, 6)
    finally:
        peer.close()
    assert first.cached.tokens == first.reference.tokens
    assert len(first.cached.tokens) == 6
    assert again.cached.cached_tokens >= len(ids) - 1
    json.dumps(summarize_peer([first, again]))
