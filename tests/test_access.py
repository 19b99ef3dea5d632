"""Access control on a real `moepipe serve` (issue 15): the API key on /v1 routes (401 without it, through the
official client and raw httpx), /health and /metrics open, a forged Host refused (DNS rebinding), and the
config's parsing of the keys and their environment variables."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import OpenAI, free_port
from gateway.access import _hostname, default_allowed_hosts
from gateway.launcher import Cluster, ServeOptions
from shared.cluster_config import ClusterConfigError, env_overrides

KEY = "s3cret-key"
KEY2 = "second-key"           # served with both (--api-key KEY KEY2): either authenticates, through cluster.toml
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    # no PLE service process (the stage gathers its PLE rows): access control is the gateway's, each process a
    # torch import
    opts = ServeOptions(model=tiny_checkpoint, stages=1, port=free_port(),
                        extra={"api_key": [KEY, KEY2], "allowed_origins": [ORIGIN], "ple_service": False,
                               "served_model_aliases": ["qwen-alias"]})
    with Cluster(opts) as c:
        yield c


def _client(url: str, key: str) -> openai.OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_the_key_is_required_on_v1_routes(server):
    ok = _client(server.url, KEY).completions.create(model="moepipe", prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError) as err:
        _client(server.url, "wrong").completions.create(model="moepipe", prompt="hi", max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"authorization": "Basic " + KEY}, {"authorization": "Bearer " + KEY + "x"}):
        r = httpx.get(server.url + "/v1/models", headers=headers, verify=False)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for key in (KEY, KEY2):
        assert httpx.get(server.url + "/v1/models", headers={"authorization": "bearer " + key},
                         verify=False).status_code == 200
    assert httpx.get(server.url + "/health", verify=False).status_code == 200
    assert httpx.get(server.url + "/metrics", verify=False).status_code == 200


def test_a_forged_host_is_refused(server):
    port = server.cluster.port
    auth = {"authorization": "Bearer " + KEY}
    r = httpx.get(server.url + "/v1/models", headers={**auth, "host": f"evil.example:{port}"}, verify=False)
    assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert httpx.get(server.url + "/v1/models", headers={**auth, "host": host}, verify=False).status_code == 200
    assert httpx.get(server.url + "/health", headers={"host": "evil.example"}, verify=False).status_code == 200
    assert httpx.get(server.url + "/ping", headers={"host": "evil.example"}, verify=False).status_code == 200


def test_cors_only_for_the_allowed_origins(server):
    """A preflight from an allowed origin is answered (without the key, which preflights never carry); other
    origins get no CORS headers, so their pages cannot read the answers."""
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers={"origin": ORIGIN, **ask}, verify=False)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(server.url + "/v1/chat/completions", headers={"origin": "http://evil.example", **ask},
                      verify=False)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={"origin": ORIGIN, "authorization": "Bearer " + KEY}, verify=False)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.url + "/v1/models",
                  headers={"origin": "http://evil.example", "authorization": "Bearer " + KEY}, verify=False)
    assert "access-control-allow-origin" not in r.headers


def test_hosts_and_keys_from_config_and_environment(monkeypatch):
    assert default_allowed_hosts("127.0.0.1") == ["localhost", "127.0.0.1", "::1"]
    assert default_allowed_hosts("::1") == default_allowed_hosts("localhost") == default_allowed_hosts("127.0.0.1")
    assert default_allowed_hosts("0.0.0.0") == ["*"] and default_allowed_hosts("myhost.lan") == ["*"]
    assert [_hostname(h) for h in ("[::1]:8000", "Example.COM:80", "::1", "localhost")] == \
        ["::1", "example.com", "::1", "localhost"]
    monkeypatch.setenv("MOEPIPE_API_KEY", "k")
    monkeypatch.setenv("MOEPIPE_ALLOWED_HOSTS", "a.lan, b.lan")
    assert env_overrides()["api_key"] == "k" and env_overrides()["allowed_hosts"] == ["a.lan", "b.lan"]
    from shared.cluster_config import cluster_from_dict

    base = {"model": "m", "stages": [{"start": 0, "end": 1, "endpoint": "ipc://x"}], "gateway_endpoint": "ipc://g"}
    monkeypatch.delenv("MOEPIPE_ALLOWED_HOSTS")
    with pytest.raises(ClusterConfigError, match="allowed_hosts"):
        cluster_from_dict({**base, "allowed_hosts": "a.lan"})


def test_every_served_name_is_listed_and_answered(server):
    """`--served-model-name moepipe qwen-alias` (vLLM's several names): both listed, both answered; a response carries
    the first, as OpenAI answers an alias with the model it resolves to."""
    client = _client(server.url, KEY)
    assert [m.id for m in client.models.list().data] == ["moepipe", "qwen-alias"]
    assert client.models.retrieve("qwen-alias").id == "qwen-alias"
    r = client.chat.completions.create(model="qwen-alias", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0)
    assert r.model == "moepipe" and r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="qwen", prompt="hi", max_tokens=2)


def test_any_of_several_keys_authenticates(tiny_checkpoint):
    """`vllm serve --api-key A B` takes several keys, any of which authenticates; here --api-key took one (`B` was an
    unrecognized argument). The flag, the cluster config (a list, through cluster.toml) and the middleware take
    several; the variables hold one key, as VLLM_API_KEY does."""
    from starlette.responses import PlainTextResponse
    from starlette.testclient import TestClient

    from gateway.access import AccessControl
    from gateway.cli import build_parser, serve_options
    from shared.cluster_config import cluster_from_dict, dump_toml

    def options(*argv):
        return serve_options(build_parser().parse_args(["serve", *argv]))

    model = str(tiny_checkpoint)
    assert options(model, "--api-key", "a", "b").extra["api_key"] == ["a", "b"]
    opts = options("--api-key", "a", model)          # vLLM's order: the model after the keys is the model
    assert opts.model == tiny_checkpoint and opts.extra["api_key"] == ["a"]
    with pytest.raises(ValueError, match="put the model first"):
        options("--api-key", model)
    base = {"model": "m", "stages": [{"start": 0, "end": 1, "endpoint": "ipc://x"}], "gateway_endpoint": "ipc://g"}
    cfg = cluster_from_dict({**base, "api_key": ["a", "b"]})
    assert 'api_key = ["a", "b"]' in dump_toml(cfg).splitlines()
    with pytest.raises(ClusterConfigError, match="api_key"):
        cluster_from_dict({**base, "api_key": ["a", 3]})
    client = TestClient(AccessControl(PlainTextResponse("ok"), api_key=cfg.api_key))
    for key, status in (("a", 200), ("b", 200), ("c", 401), ("", 401)):
        assert client.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == status, key
    assert TestClient(AccessControl(PlainTextResponse("ok"), api_key=["", ""])).get("/v1/models").status_code == 200
