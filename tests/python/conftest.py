"""Starts `nibble serve` (release build, default model) on free loopback ports for the tests."""
import os
import socket
import subprocess
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NIBBLE = os.environ.get("NIBBLE_BIN", os.path.join(ROOT, "target", "release", "nibble"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(ROOT, "target", f"serve-{self.port}.log"), "w")
        self.proc = subprocess.Popen([NIBBLE, "--threads", "2", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nibble serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if urllib.request.urlopen(self.base + "/health", timeout=1).read() == b"ok":
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("nibble serve did not come up in 120 s")

    def metrics(self):
        text = urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                k, v = line.split()
                out[k] = float(v)
        return out

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    assert s.proc.poll() is None, "the server died during the tests"
    s.stop()


@pytest.fixture(scope="session")
def keyed_server():
    s = Server("--api-key", "sekrit", "--served-model-name", "smol")
    yield s
    s.stop()


# Small limits, so that the tests of timeouts and sizes run fast.
LIMITS = {"header_timeout": 1.5, "body_timeout": 1.5, "max_body_bytes": 65536, "max_messages": 8,
          "max_stop_strings": 4}


@pytest.fixture(scope="session")
def limits_server():
    s = Server(*[a for k, v in LIMITS.items() for a in ("--" + k.replace("_", "-"), str(v))])
    s.limits = LIMITS
    yield s
    assert s.proc.poll() is None, "the server died during the tests"
    s.stop()


@pytest.fixture(scope="session")
def tiny_queue_server():
    s = Server("--max-waiting", "1", "--max-num-seqs", "1")
    yield s
    s.stop()
