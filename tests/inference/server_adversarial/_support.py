"""Helpers of the adversarial server tests: raw HTTP with timeouts, SSE parsing, in-process and CLI servers.

Every client call here has a timeout, so a server that hangs fails a test instead of stalling CI.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 30.0


@dataclass
class Reply:
    """One HTTP answer."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> dict[str, Any]:
        """OpenAI's error object; asserts the body has that shape."""
        payload = self.json()
        assert set(payload["error"]) >= {"message", "type", "param", "code"}, payload
        return payload["error"]


def request(port: int, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = TIMEOUT_S) -> Reply:
    """One HTTP request to 127.0.0.1:``port`` (``body`` as JSON, or ``raw`` bytes as they are)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        sent = {"Content-Type": "application/json"} if data is not None else {}
        sent.update(headers or {})
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def post(port: int, path: str, body: Any, **kwargs: Any) -> Reply:
    """``POST`` JSON."""
    return request(port, "POST", path, body, **kwargs)


def sse_events(body: bytes) -> list[Any]:
    """The ``data:`` payloads of a server-sent-events body (``"[DONE]"`` kept as a string)."""
    events = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_text(events: list[Any]) -> str:
    """The text of a completions or chat stream."""
    out = []
    for event in events:
        if isinstance(event, dict) and "choices" in event:
            choice = event["choices"][0]
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def wait_until(predicate: Any, timeout: float = TIMEOUT_S) -> bool:
    """Poll ``predicate`` until true or ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


class CharTokenizer:
    """A character tokenizer with a chat template, in plain Python (no transformers import: fast to set up).

    Ids: 0 unknown, 1 BOS, 2 EOS, then :data:`CHARS`; ``vocab_size`` is the model's (128).
    """

    vocab_size, bos, eod = 128, 1, 2

    def tokenize(self, text: str) -> list[int]:
        return [3 + CHARS.index(c) if c in CHARS else 0 for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(CHARS[i - 3] for i in ids if 3 <= i < 3 + len(CHARS))

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def tiny_model() -> Any:
    """A random two-layer GPTModel (vocabulary 128, 256 positions, rope), single process."""
    import torch
    import torch.nn.functional as F

    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_core.transformer import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, init_method_std=0.2,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), 128, 256, position_embedding_type="rope").eval()


class InProcessServer:
    """A ``MegatronAsyncLLM`` serving on 127.0.0.1 (port 0) from a thread of this process."""

    def __init__(self, llm: Any, serve_config: Any) -> None:
        self.llm = llm
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(llm.serve(serve_config, blocking=False), self.loop).result(timeout=60)
        self.port = llm.server_port
        self.app = llm._server.config.app

    def stop(self) -> None:
        """Shut the server and the engine down, stop the thread."""
        try:
            asyncio.run_coroutine_threadsafe(self.llm.shutdown(), self.loop).result(timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def cli_env() -> dict[str, str]:
    """The environment of a CLI subprocess (one thread, this checkout first on the path)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}:{REPO}", "PYTHONUNBUFFERED": "1"}


def start_cli_server(checkpoint: Path, *extra: str, log: Path) -> tuple[subprocess.Popen, int]:
    """``megatron-serve --load checkpoint --port 0 ...`` in a subprocess; ``(process, port)`` once it serves."""
    out = open(log, "w")  # noqa: SIM115 - closed by stop_cli_server
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_core.inference.cli.serve", "--load", str(checkpoint), "--port", "0",
         "--model-name", "tiny", "--buffer-size-gb", "0.01", "--block-size-tokens", "16", *extra],
        cwd=REPO, env=cli_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )
    proc.log_file = out  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = log.read_text()
        if "serving " in text:
            port = int(text.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
            return proc, port
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    stop_cli_server(proc)
    raise AssertionError(f"megatron-serve did not start:\n{log.read_text()[-4000:]}")


def stop_cli_server(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 30) -> int | None:
    """Send ``sig`` to the server's process group, wait (SIGKILL after ``timeout``); its exit status."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return None
    except ProcessLookupError:
        return proc.poll()
    finally:
        proc.log_file.close()  # type: ignore[attr-defined]


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN state that process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if family == socket.AF_INET:
                address = socket.inet_ntop(family, raw[::-1])
            else:  # four little-endian 32-bit words
                address = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append((address, int(hex_port, 16)))
    return found
