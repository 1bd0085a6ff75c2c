"""Who may use `rayspec serve`: the API key on every route but /health and the chat page (checked on the FastAPI app
itself, every route listed from the app, so a new route cannot escape), CORS, the bind rule; then through Ray Serve
with the official `openai` client, wrong keys arriving while requests decode."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import requests
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from test_serve_and_faults import ray_local  # noqa: F401 - the module's local Ray, as a fixture

KEY = "sk-rayspec-test-key"
PORT = 8768


@pytest.fixture
def client(monkeypatch):
    """A test client of the Serve app as a replica runs it: ``client(access)`` -> TestClient, with a stand-in
    replica (no models) behind the class-based routes."""
    from ray import serve

    import actors.serve_app as sa

    def make(access):
        replica = SimpleNamespace(access=access, admission=sa.Admission(), models={"whisper-1"}, speech=None,
                                  chat=None, transcriber=SimpleNamespace(target=SimpleNamespace(name="tiny"),
                                                                         options=SimpleNamespace(method="ar")))
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=replica))
        return TestClient(sa.api)

    return make


def _routes(router=None, prefix=""):
    """``(path, method)`` of every route of the app: HTTP methods, and "websocket" (FastAPI >= 0.137 keeps routes
    that Serve's class-based view re-includes in an ``_IncludedRouter`` node: walked into)."""
    from actors.serve_app import api

    out = []
    for route in (router or api).routes:
        if hasattr(route, "original_router"):
            out += _routes(route.original_router, prefix + route.include_context.prefix)
            continue
        methods = getattr(route, "methods", None)
        path = prefix + route.path
        out += [(path, m) for m in sorted(methods - {"HEAD"})] if methods else [(path, "websocket")]
    return out


def test_every_route_but_health_and_the_chat_page_needs_the_key(client):
    from actors.serve_app import OPEN_PATHS, Access

    routes = _routes()
    assert {("/v1/audio/transcriptions", "POST"), ("/v1/models", "GET"), ("/v1/audio/speech", "POST"),
            ("/v1/audio/voices", "GET"), ("/v1/realtime", "websocket"), ("/openapi.json", "GET")} <= set(routes)
    assert {p for p, _ in routes if p in OPEN_PATHS} == {"/health", "/"}
    c = client(Access(KEY))
    for path, method in routes:
        if path in OPEN_PATHS:
            continue
        if method == "websocket":
            for kw in ({}, {"headers": {"Authorization": "Bearer sk-wrong"}}, {"subprotocols": ["realtime"]}):
                with pytest.raises(WebSocketDisconnect) as refused, c.websocket_connect(path, **kw):
                    pass
                assert refused.value.code == 1008
            for kw in ({"headers": {"Authorization": f"Bearer {KEY}"}},
                       {"subprotocols": ["realtime", f"openai-insecure-api-key.{KEY}"]}):
                with c.websocket_connect(path, **kw) as ws:  # chat is off here: an error event, then close
                    assert "voice chat is off" in ws.receive_text()  # a browser needs one offered protocol echoed:
                    assert ws.accepted_subprotocol == ("realtime" if "subprotocols" in kw else None)  # not the key
            continue
        for headers, message in (({}, "needs an API key"), ({"Authorization": "Bearer sk-wrong"}, "incorrect"),
                                 ({"Authorization": f"Bearer {KEY}x"}, "incorrect"),
                                 ({"Authorization": f"Basic {KEY}"}, "needs an API key")):
            r = c.request(method, path, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, method, headers)
            assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                          "param": None, "code": "invalid_api_key"}}
            assert message in r.json()["error"]["message"] and KEY not in r.text
        r = c.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code != 401, (path, method)
    assert c.get("/health").json()["status"] == "ok"
    assert c.get("/").status_code == 404  # the chat page, open (chat is off here)
    assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).json()["data"][0]["id"] == "whisper-1"


def test_without_a_key_every_route_is_open(client):
    from actors.serve_app import Access

    c = client(Access())
    assert c.get("/v1/models").status_code == 200
    assert c.post("/v1/audio/transcriptions").status_code == 400  # no file: validation, not the key


def test_cors_is_closed_unless_origins_are_named(client):
    from actors.serve_app import Access

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization"}
    closed = client(Access(KEY))
    assert "access-control-allow-origin" not in closed.get("/health", headers={"Origin": "https://app.example"}).headers
    assert closed.options("/v1/audio/transcriptions", headers=preflight).status_code == 401
    c = client(Access(KEY, ("https://app.example",)))
    r = c.options("/v1/audio/transcriptions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert c.options("/v1/audio/transcriptions", headers={**preflight, "Origin": "https://evil.example"}).status_code == 400
    refused = c.get("/v1/models", headers={"Origin": "https://app.example"})  # the page can read why
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
    ok = c.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"


def test_build_app_reads_the_key_and_origins(monkeypatch):
    from actors.serve_app import Access, build_app

    app = build_app({"api_key": KEY, "allowed_origins": "https://a.example, https://b.example"})
    assert app._bound_deployment.init_args[-1] == Access(KEY, ("https://a.example", "https://b.example"))
    assert build_app({})._bound_deployment.init_args[-1] == Access()


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True),
                                            ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("::", False),
                                            ("192.168.1.5", False), ("example.com", False)])
def test_loopback_hosts(host, loopback):
    from rayspec.cli import is_loopback

    assert is_loopback(host) is loopback


def test_serve_refuses_a_network_host_without_a_key(capsys, monkeypatch):
    """The refusal comes before Ray starts; the key may come from RAYSPEC_API_KEY."""
    from rayspec.cli import EXIT_USAGE, build_parser, main

    monkeypatch.delenv("RAYSPEC_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key" in err and "--allow-unauthenticated" in err
    monkeypatch.setenv("RAYSPEC_API_KEY", KEY)
    assert build_parser().parse_args(["serve", "--host", "0.0.0.0"]).api_key == KEY


def test_openai_client_with_the_key_while_wrong_keys_arrive(ray_local, samples_manifest, tiny_target):  # noqa: F811
    """Through Ray Serve: the `openai` client with ``api_key=`` gets its transcripts (200) while requests with a
    wrong or no key, sent alongside, get 401 and harm none of them; /health stays open."""
    import openai
    from ray import serve

    from actors.serve_app import build_app
    from rayspec.manifest import read_manifest
    from rayspec.options import decode_options_from
    from rayspec.pipeline import Transcriber

    utts = read_manifest(samples_manifest)
    local = Transcriber(tiny_target.model.name_or_path, options=decode_options_from({"max_tokens_per_second": 4}))
    expected = {u.id: r.text for u, r in zip(utts, local.transcribe(utts))}
    clips = {u.id: open(u.audio, "rb").read() for u in utts}
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({"target": tiny_target.model.name_or_path, "max_batch_size": 8, "num_cpus": 0.5,
                         "max_tokens_per_second": 4, "api_key": KEY}), name="rayspec", route_prefix="/")
    try:
        url = f"http://127.0.0.1:{PORT}"
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0)

        def ask(i):
            u = utts[i % len(utts)]
            if i % 2:
                return u.id, good.audio.transcriptions.create(model="whisper-1", file=("a.flac", clips[u.id])).text
            if i % 4:
                with pytest.raises(openai.AuthenticationError) as refused:
                    bad.audio.transcriptions.create(model="whisper-1", file=("a.flac", clips[u.id]))
                return None, refused.value.code
            r = requests.post(f"{url}/v1/audio/transcriptions", files={"file": ("a.flac", clips[u.id])}, timeout=60)
            return None, (r.status_code, r.json()["error"]["code"])

        with ThreadPoolExecutor(max_workers=12) as pool:
            results = list(pool.map(ask, range(24)))
        texts = [(uid, text) for uid, text in results if uid]
        assert len(texts) == 12 and all(text == expected[uid] for uid, text in texts)
        assert [r for uid, r in results if not uid] == [(401, "invalid_api_key"), "invalid_api_key"] * 6
        assert [m.id for m in good.models.list()] and requests.get(f"{url}/health", timeout=30).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        serve.shutdown()
