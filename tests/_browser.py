"""Headless Chromium driven over the DevTools protocol, for the HTML report's tests.

The protocol runs over a pipe (``--remote-debugging-pipe``: commands on fd 3, replies on
fd 4, each message NUL-terminated JSON), so no websocket client and no port are needed.
The browser records every console message, uncaught exception and network request of
the page, which is what the tests judge.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--mute-audio"]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class Page:
    console: list[str] = field(default_factory=list)  # errors and warnings, as text
    exceptions: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for


class Browser:
    def __init__(self, profile: Path, width: int = 1400, height: int = 1000) -> None:
        binary = chromium()
        assert binary is not None
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        self.proc = self._spawn(binary, profile, width, height, to_browser_r, from_browser_w)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._id = 0
        self._events: list[dict[str, Any]] = []

    @staticmethod
    def _spawn(binary: str, profile: Path, width: int, height: int, read_end: int,
               write_end: int) -> subprocess.Popen[bytes]:
        def child() -> None:
            # The browser reads commands on fd 3 and writes replies on fd 4. Copies first:
            # one of our ends may itself be 3 or 4.
            read, write = os.dup(read_end), os.dup(write_end)
            os.dup2(read, 3)
            os.dup2(write, 4)

        return subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            pass_fds=(3, 4), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=child,
            start_new_session=True,
        )

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 30) -> dict[str, Any]:
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            self._events.append(reply)

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the browser did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("the browser closed its DevTools pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(message))

    def drain(self, seconds: float) -> None:
        """Collect the events that arrive in the next ``seconds``."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(TimeoutError):
            while True:
                self._events.append(self._receive(deadline))

    def open(self, url: str, *, ready: str, timeout: float = 60) -> tuple[str, Page]:
        """Open ``url`` in a fresh tab; wait until the JS expression ``ready`` is true."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target,
                                                       "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.send(f"{domain}.enable", session=session)
        self._events.clear()
        self.send("Page.navigate", {"url": url}, session=session)
        deadline = time.monotonic() + timeout
        while not self.evaluate(session, ready):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never got ready ({ready})")
            self.drain(0.2)
        self.drain(0.5)  # what the page does right after it is drawn counts too
        page = Page()
        for event in self._events:
            if event.get("sessionId") != session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error",
                                                                               "warning"):
                page.console.append(" ".join(str(a.get("value", a.get("description")))
                                             for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") in ("error",
                                                                                  "warning"):
                page.console.append(params["entry"].get("text", ""))
            elif method == "Runtime.exceptionThrown":
                page.exceptions.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Network.requestWillBeSent":
                page.requests.append(params["request"]["url"])
        return session, page

    def evaluate(self, session: str, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True}, session=session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, session: str) -> bytes:
        import base64

        data = self.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def browser(profile: Path) -> Iterator[Browser]:
    b = Browser(profile)
    try:
        yield b
    finally:
        b.close()


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the rows of an 8-bit RGB or RGBA PNG (what Chromium writes), each
    row as bytes of pixels. Enough of PNG to judge a screenshot, nothing more."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8, depth
            assert color in (2, 6), color
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line) if channels == 3 else
                    b"".join(bytes(line[i:i + 3]) for i in range(0, stride, 4)))
        previous = line
    return width, height, rows
