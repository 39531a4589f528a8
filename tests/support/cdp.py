"""Headless Chromium driven over the DevTools protocol, and a static file server, for the browser tests.

Only what the tests need: open a page, evaluate an expression (awaiting its promise), capture an
element as a PNG, and keep what the page logged so a failure can show it.
"""
from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

CHROMIUMS = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUMS) if p), None)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the test output
        pass


@contextlib.contextmanager
def serve(root: Path):
    """Serve `root` on 127.0.0.1 (a free port) from a thread; yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class PageError(AssertionError):
    pass


class Browser:
    """One headless Chromium with one page. Use as a context manager."""

    def __init__(self, profile: Path, timeout: float = 120.0, width: int = 1000, height: int = 900):
        import websocket  # websocket-client (the test extra)

        exe = find_chromium()
        if exe is None:
            raise RuntimeError("no Chromium on PATH")
        profile.mkdir(parents=True, exist_ok=True)
        self.log = open(profile / "chromium.log", "w+")
        # root on CI needs --no-sandbox; containers give /dev/shm little room
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"Chromium did not start (exit {self.proc.returncode}): {self._log_tail()}")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t["type"] == "page")
        # Chromium refuses DevTools connections that send an Origin it was not told to allow
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True)
        self.timeout, self._id, self.console = timeout, 0, []
        for domain in ("Page", "Runtime"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _log_tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-5:])

    def call(self, method: str, **params):
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise PageError(f"{method}: {msg['error'].get('message')}")
                return msg["result"]
            self._event(msg)

    def _event(self, msg: dict) -> None:
        p = msg.get("params", {})
        if msg.get("method") == "Runtime.consoleAPICalled":
            self.console.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description", "")))
                                                                   for a in p.get("args", [])))
        elif msg.get("method") == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.console.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "")))

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def wait_for(self, condition: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.evaluate(condition):
            if time.monotonic() > deadline:
                raise PageError(f"timed out waiting for {condition}; page console: {self.console[-5:]}")
            time.sleep(0.1)

    def evaluate(self, expression: str, await_promise: bool = True):
        """The JSON value of `expression` (a promise is awaited); a thrown error fails with its message."""
        r = self.call("Runtime.evaluate", expression=expression, awaitPromise=await_promise, returnByValue=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise PageError((d.get("exception", {}).get("description") or d.get("text", "")).splitlines()[0])
        return r["result"].get("value")

    def screenshot(self, selector: str, path: Path) -> Path:
        """Capture the element matching `selector` as a PNG at `path`."""
        rect = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                             " return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height}; })()")
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={**{k: round(v) for k, v in rect.items()}, "scale": 1})
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
