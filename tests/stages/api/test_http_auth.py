"""API keys on the HTTP front, with the real openai client: no key or a wrong key is 401 in
OpenAI's error JSON, the tenant is the key's (two tenants never share cached blocks, and a
tenant's own repeat hits), /flush_cache needs an admin key, /health stays open."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvflow.stages.api.auth import ApiKeys, Authenticator
from kvflow.stages.serve.config import HttpConfig
from tests.e2e.conftest import ServerThread, base_config

ALICE, BOB, ROOT = "alice-http-key-0123456", "bob-http-key-01234567", "root-http-key-0123456"
PROMPT = list(range(7, 7 + 100))


@pytest.fixture(scope="module")
def keyed(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    data = tmp_path_factory.mktemp("http-keys")
    keyfile = data / "keys.txt"
    keyfile.write_text(f"{ALICE} alice user\n{BOB} bob user\n{ROOT} - admin\n")
    server = ServerThread(
        base_config(chat_model, data / "d"),
        http=HttpConfig(port=0),
        auth=Authenticator(ApiKeys.load(keyfile)),
    )
    yield server
    server.close()


def client(server: ServerThread, key: str) -> openai.OpenAI:
    assert server.http is not None
    return openai.OpenAI(base_url=server.http.url + "/v1", api_key=key, max_retries=0)


def cached(server: ServerThread, key: str) -> int:
    out = client(server, key).completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return int(out.usage.prompt_tokens_details.cached_tokens or 0)


def test_no_key_or_a_wrong_key_is_401(keyed: ServerThread) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        client(keyed, "not-a-key").models.list()
    assert err.value.status_code == 401
    assert keyed.http is not None  # the openai client always sends a key: no key by hand
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(keyed.http.url + "/v1/models", timeout=30)
    assert raw.value.code == 401 and "error" in json.loads(raw.value.read())
    assert client(keyed, ALICE).models.list().data  # a known key passes


def test_the_tenant_comes_from_the_key(keyed: ServerThread) -> None:
    assert cached(keyed, ALICE) == 0
    assert cached(keyed, ALICE) == 96  # alice's own repeat hits her blocks
    assert cached(keyed, BOB) == 0  # bob sees none of them: another tenant's namespace


def _post(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        assert "error" in json.loads(exc.read())
        return int(exc.code)


def test_flush_cache_needs_an_admin_key_and_health_is_open(keyed: ServerThread) -> None:
    assert keyed.http is not None
    base = keyed.http.url
    assert _post(base + "/flush_cache", None) == 401
    assert _post(base + "/flush_cache", ALICE) == 403
    assert _post(base + "/flush_cache", ROOT) == 200
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        assert r.status == 200
