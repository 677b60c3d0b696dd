"""Headless Chromium driven over the DevTools protocol, for the report's browser test.

`ensure_chromium()` finds Debian's `chromium` (installing it with apt-get when missing, as root, if
possible) or returns None with the reason; `load_page(path)` opens a file in a fresh profile, waits for the
load event and returns every image's load state plus every console error, uncaught exception and browser
log error (a Content-Security-Policy violation included).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
         "--disable-sync", "--remote-debugging-port=0"]


def ensure_chromium() -> tuple[str | None, str]:
    """(path, '') when chromium is usable, else (None, why not)."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name), ""
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "chromium is not installed and cannot be installed here (needs root and apt-get): " \
                     "run `apt-get update && apt-get install -y chromium`"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            if r.returncode != 0:
                return None, f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-400:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"installing chromium failed: {e}"
    path = shutil.which("chromium")
    return (path, "") if path else (None, "apt-get installed chromium but it is not on PATH")


@dataclass
class PageResult:
    images: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    title: str = ""
    scripts: int = 0
    text: str = ""


class _CDP:
    """A minimal synchronous DevTools client: commands with ids, events buffered per session."""

    def __init__(self, ws_url: str):
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=None, open_timeout=30)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e["method"] == method for e in self.events):
                return True
            try:
                self.events.append(json.loads(self.ws.recv(timeout=max(0.05, deadline - time.monotonic()))))
            except TimeoutError:
                break
        return any(e["method"] == method for e in self.events)

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self.events.append(json.loads(self.ws.recv(timeout=max(0.05, deadline - time.monotonic()))))
            except TimeoutError:
                return

    def close(self) -> None:
        self.ws.close()


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append(f"log ({p['entry'].get('source')}): {p['entry'].get('text')}")
    return out


def load_page(chromium: str, page: Path, timeout: float = 60.0) -> PageResult:
    """Open `page` (a local file) headless; report images and errors seen up to shortly after the load event."""
    # Chromium's helpers (zygote, crashpad, utility processes) outlive the browser process by a moment and
    # keep writing into the profile: start them in their own process group, end the whole group, and only
    # then remove the profile (removing it while they still write fails: "Directory not empty: 'Default'").
    profile = tempfile.mkdtemp(prefix="tandem-chromium-")
    try:
        proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        cdp = None
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + timeout
            while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
                if proc.poll() is not None:
                    raise RuntimeError(f"chromium exited with code {proc.returncode} before DevTools came up")
                if time.monotonic() > deadline:
                    raise TimeoutError("chromium did not open its DevTools port")
                time.sleep(0.1)
            port, path = port_file.read_text().split()[:2]
            cdp = _CDP(f"ws://127.0.0.1:{port}{path}")
            target = cdp.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                cdp.call(f"{domain}.enable", session=session)
            cdp.events.clear()  # only what the page itself causes counts
            nav = cdp.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
            if nav.get("errorText"):
                raise RuntimeError(f"navigation failed: {nav['errorText']}")
            if not cdp.wait_event("Page.loadEventFired", timeout):
                raise TimeoutError(f"{page} did not finish loading in {timeout:.0f}s")
            cdp.drain(0.5)  # late console messages and CSP reports
            js = ("JSON.stringify({title: document.title, scripts: document.scripts.length, "
                  "text: document.body ? document.body.innerText : '', images: Array.from(document.images).map(i => "
                  "({alt: i.alt.slice(0, 60), complete: i.complete, naturalWidth: i.naturalWidth, "
                  "naturalHeight: i.naturalHeight}))})")
            res = cdp.call("Runtime.evaluate", {"expression": js, "returnByValue": True}, session=session)
            doc = json.loads(res["result"]["value"])
            cdp.drain(0.2)
            try:
                cdp.call("Browser.close", timeout=5)
            except Exception:  # the browser may drop the socket while closing; the process wait below decides
                pass
            return PageResult(images=doc["images"], errors=_errors(cdp.events), title=doc["title"],
                              scripts=doc["scripts"], text=doc["text"])
        finally:
            if cdp is not None:
                try:
                    cdp.close()
                except Exception:
                    pass
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
            _end_group(proc.pid)
    finally:
        _remove_profile(profile)


def _end_group(pgid: int) -> None:
    """Terminate what is left of chromium's process group, then kill it if it lingers past a few seconds."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)


def _remove_profile(profile: str) -> None:
    """Remove the profile, retrying while a straggler finishes a write; a leftover temp dir never fails a test."""
    for _ in range(20):
        try:
            shutil.rmtree(profile)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.25)
    shutil.rmtree(profile, ignore_errors=True)
