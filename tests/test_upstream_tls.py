"""TLS to `https://` workers through the one upstream client: a simulated vLLM worker served over TLS with a
certificate from a CA made at test time (openssl CLI), checked with `ca_bundle`, refused without it, accepted
with `verify: false`, and client-certificate authentication for a worker that demands one. End to end, the
gateway's health checks, discovery, scrapes and relayed requests all reach the TLS worker with these settings."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from gateway.wire.upstream import ClientConnectorError, TlsSettings
from tests.helpers import MODEL, poll, require_command, running_gateway
from tests.test_upstream import pool
from tests.test_upstream_pool import CountingResolver


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path          # a CA that signed nothing here


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([require_command("openssl"), *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN=fleetgate test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _leaf(d: Path, name: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other")
    _leaf(d, "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "extendedKeyUsage=clientAuth\n")
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key", d / "other.pem")


def tls_worker(sim_fleet, pki: Pki, client_auth: bool = False) -> str:  # noqa: ANN001
    tls = {"ssl_certfile": str(pki.server_cert), "ssl_keyfile": str(pki.server_key)}
    if client_auth:
        tls |= {"ssl_ca_certs": str(pki.ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    url = sim_fleet(1, time_scale=20, tls=tls).urls[0]
    assert url.startswith("https://")
    return url


async def test_verified_with_the_ca_bundle_refused_without_it(sim_fleet, pki: Pki) -> None:
    url = tls_worker(sim_fleet, pki)
    async with pool(tls=TlsSettings(ca_bundle=str(pki.ca))) as p:
        r = await p.fetch(url + "/v1/models", 5.0)
        assert r.status == 200 and MODEL.encode() in r.body
    for wrong in (TlsSettings(), TlsSettings(ca_bundle=str(pki.other_ca))):  # system CAs; an unrelated CA
        async with pool(tls=wrong) as p:
            with pytest.raises(ClientConnectorError, match="CERTIFICATE_VERIFY_FAILED"):
                await p.fetch(url + "/health", 5.0)
    async with pool(tls=TlsSettings(verify=False)) as p:  # verify off: any certificate
        assert (await p.fetch(url + "/health", 5.0)).status == 200


async def test_the_host_name_is_checked_too(sim_fleet, pki: Pki) -> None:
    """The certificate names 127.0.0.1 and localhost: a worker reached as `worker.test` (resolved to the same
    address) is refused, as `localhost` accepted."""
    port = int(tls_worker(sim_fleet, pki).rsplit(":", 1)[1])
    to_loopback = CountingResolver()
    async with pool(tls=TlsSettings(ca_bundle=str(pki.ca)), resolver=to_loopback) as p:
        with pytest.raises(ClientConnectorError, match="CERTIFICATE_VERIFY_FAILED"):
            await p.fetch(f"https://worker.test:{port}/health", 5.0)
        assert (await p.fetch(f"https://localhost:{port}/health", 5.0)).status == 200
        assert to_loopback.calls == ["worker.test", "localhost"]


async def test_client_certificate_for_a_worker_that_demands_one(sim_fleet, pki: Pki) -> None:
    url = tls_worker(sim_fleet, pki, client_auth=True)
    async with pool(tls=TlsSettings(ca_bundle=str(pki.ca))) as p:
        with pytest.raises((ClientConnectorError, ConnectionError, TimeoutError)):
            await p.fetch(url + "/health", 5.0)  # the worker refuses the handshake (or drops the request)
    mtls = TlsSettings(ca_bundle=str(pki.ca), client_cert=str(pki.client_cert), client_key=str(pki.client_key))
    async with pool(tls=mtls) as p:
        for _ in range(2):  # and the connection is kept alive
            assert (await p.fetch(url + "/health", 5.0)).status == 200
        assert p.open_connections() == 1


async def test_the_gateway_serves_a_tls_worker_with_client_auth(sim_fleet, pki: Pki) -> None:
    url = tls_worker(sim_fleet, pki, client_auth=True)
    tls = {"ca_bundle": str(pki.ca), "client_cert": str(pki.client_cert), "client_key": str(pki.client_key)}
    async with running_gateway([url], upstream={"tls": tls}, scrape_interval_s=0.1) as gw:
        registry = gw.gateway.registry
        await poll(lambda: registry.any_healthy() and registry.knows_model(MODEL), what="health check and discovery")
        await poll(lambda: registry.workers["w0"].metrics.scraped_at > 0, what="a /metrics scrape")
        client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5)
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    async with running_gateway([url], upstream={"tls": {"ca_bundle": str(pki.ca)}}, health={"interval_s": 0.1}) as gw:
        await poll(lambda: gw.gateway.registry.workers["w0"].checked, what="a health check")
        assert not gw.gateway.registry.any_healthy()  # no client certificate: the worker refuses the gateway


def test_tls_settings_are_checked_when_the_config_loads(tmp_path: Path, pki: Pki) -> None:
    from gateway.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, upstream={"tls": {"ca_bundle": str(tmp_path / "missing.pem")}})
    with pytest.raises(ConfigError, match="client_key is set without client_cert"):
        load_config(None, upstream={"tls": {"client_key": str(pki.client_key)}})
