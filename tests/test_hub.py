"""mha.models.load(name) for a Hugging Face Hub name: the local cache first, then a download
with huggingface_hub (config, safetensors and tokenizer files only), or with HF_HUB_OFFLINE set
an error that says what to do.

The Hub is a local HTTP server on 127.0.0.1 (http.server in a thread) that answers as the Hub
does: ``/api/models/{repo}/revision/{rev}`` (the model info, with its commit and files),
``/api/models/{repo}/tree/{rev}`` (the file list) and ``/{repo}/resolve/{rev}/{file}`` (HEAD
and GET, with X-Repo-Commit, ETag, Content-Length and byte ranges); HF_ENDPOINT points at it
and HF_HOME at a temporary folder. Every test also refuses any connection that is not to the
loopback address, so nothing here can reach the internet.
"""
import hashlib
import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import mha.models

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

import tiny_models  # noqa: E402

REPO = "someone/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
CHUNK = 1 << 16


class FakeHub(ThreadingHTTPServer):
    """A Hub of one commit per repo on 127.0.0.1. ``files[repo][path]`` are the bytes served;
    ``requests`` logs (method, path, Range header); ``cut[path] = k`` sends the next k GETs of
    ``path`` half-way and closes the connection; ``refuse`` holds paths whose other GETs are
    answered 503."""
    daemon_threads = True

    def __init__(self, files):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files, self.requests, self.cut, self.refuse = files, [], {}, set()
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def served(self, method, path):
        """How many requests ``method`` of ``path`` (a file of REPO) the server answered."""
        return sum(1 for m, p, _ in self.requests if m == method and p.endswith("/" + path))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _json(self, data, status=200, headers=()):
        raw = json.dumps(data).encode()
        self.send_response(status)
        for k, v in [("Content-Type", "application/json"), ("Content-Length", str(len(raw))),
                     *headers]:
            self.send_header(k, v)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(raw)

    def _not_found(self, code):
        self._json({"error": code}, 404, [("X-Error-Code", code)])

    def _answer(self, body):
        hub = self.server
        path = self.path.split("?")[0]
        with hub.lock:
            hub.requests.append((self.command, path, self.headers.get("Range")))
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            kind = "revision" if "/revision/" in rest else "tree"
            repo, _, _ = rest.partition(f"/{kind}/")
            if repo not in hub.files:
                return self._not_found("RepoNotFound")
            files = hub.files[repo]
            if kind == "revision":
                return self._json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": f} for f in files]})
            entries = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d}
                       for d in sorted({f.rpartition("/")[0] for f in files} - {""})]
            for f, data in files.items():
                entry = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": f}
                if f.endswith((".safetensors", ".bin")):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                    "pointerSize": 134}
                entries.append(entry)
            return self._json(entries)
        repo, _, rest = path.lstrip("/").partition("/resolve/")
        _, _, name = rest.partition("/")
        if repo not in hub.files:
            return self._not_found("RepoNotFound")
        if name not in hub.files[repo]:
            return self._not_found("EntryNotFound")
        data = hub.files[repo][name]
        with hub.lock:
            cut = body and hub.cut.get(name, 0) > 0
            if cut:
                hub.cut[name] -= 1
        if body and not cut and name in hub.refuse:
            return self._json({"error": "unavailable"}, 503)
        etag = (hashlib.sha256(data).hexdigest() if name.endswith(".safetensors")
                else _git_oid(data))
        start, status = 0, 200
        if body and self.headers.get("Range", "").startswith("bytes="):
            start, status = int(self.headers["Range"][6:].split("-")[0]), 206
        self.send_response(status)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        if cut:                                      # half of the rest, then hang up
            self.wfile.write(data[start:start + (len(data) - start) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data[start:])


def _git_oid(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny LLaMA's folder and the files the fake Hub serves for it: its own, a pickle
    weight file and an ONNX export that must never be fetched, and a README."""
    folder = tmp_path_factory.mktemp("hub-source")
    tiny_models.build("llama", folder)
    files = {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}
    files.update({"pytorch_model.bin": b"a pickle that must never be fetched",
                  "onnx/model.onnx": b"never fetched either", "README.md": b"# tiny\n"})
    return folder, files


@pytest.fixture
def hub(source, tmp_path, monkeypatch):
    """A running FakeHub serving REPO, pointed at by HF_ENDPOINT, with HF_HOME in tmp_path,
    downloads allowed, no token, and every non-loopback connection refused."""
    import huggingface_hub.constants as constants

    _refuse_the_internet(monkeypatch)
    server = FakeHub({REPO: dict(source[1])})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "XDG_CACHE_HOME",
                "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path))
    # huggingface_hub read these when it was imported (maybe offline, by another test module)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    # a transfer keeps what it received in whole chunks (10 MB by default): small chunks, so
    # that a cut half-way through the tiny model's weights leaves some on disk
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    yield server
    server.shutdown()
    server.server_close()


def _refuse_the_internet(monkeypatch):
    """Connections and name lookups go to the loopback address only."""
    connect, lookup = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(sock, address):
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            raise AssertionError(f"a test tried to reach {address}")
        return connect(sock, address)

    def guarded_lookup(host, *args, **kwargs):
        if host not in LOOPBACK:
            raise AssertionError(f"a test tried to look up {host!r}")
        return lookup(host, *args, **kwargs)
    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_lookup)


def snapshot(tmp_path):
    return tmp_path / "hf" / "hub" / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT


def same_model(model, folder):
    """The downloaded model computes what the source folder's does, bit for bit."""
    text = tiny_models.TEXTS[0]
    expected = mha.models.load(folder).encode(text)
    got = model.encode(text)
    assert got.tokens == expected.tokens
    np.testing.assert_array_equal(got.hidden_states, expected.hidden_states)
    np.testing.assert_array_equal(got.attentions, expected.attentions)


def test_load_downloads_config_weights_and_tokenizer_only(hub, source, tmp_path):
    folder, files = source
    model = mha.models.load(REPO)
    assert model.folder == snapshot(tmp_path)
    same_model(model, folder)
    assert sorted(p.name for p in model.folder.iterdir()) == ["config.json",
                                                              "generation_config.json",
                                                              "model.safetensors",
                                                              "tokenizer.json"]
    assert (model.folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    for never in ("pytorch_model.bin", "onnx/model.onnx", "README.md"):
        assert hub.served("GET", never) == hub.served("HEAD", never) == 0, never
    assert hub.served("GET", "model.safetensors") == 1
    # the second load finds the snapshot in the cache: no request at all
    before = len(hub.requests)
    assert mha.models.load(REPO).folder == model.folder
    assert len(hub.requests) == before


def test_interrupted_download_resumes_where_it_stopped(hub, source, tmp_path):
    """The server hangs up half-way through model.safetensors: huggingface_hub asks for the
    rest (a Range request) and the same load completes."""
    hub.cut["model.safetensors"] = 1
    model = mha.models.load(REPO)
    same_model(model, source[0])
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    kept = len(source[1]["model.safetensors"]) // 2 // CHUNK * CHUNK    # the whole chunks
    assert kept > 0 and ranges == [None, f"bytes={kept}-"]
    blobs = snapshot(tmp_path).parent.parent / "blobs"
    assert not list(blobs.glob("*.incomplete"))


def test_failed_download_leaves_no_broken_snapshot_and_the_next_load_completes(
        hub, source, tmp_path, monkeypatch):
    """The server hangs up half-way through model.safetensors and then refuses it: the load
    fails naming the endpoint and the cache; the files in the cache are whole and the snapshot
    has no weights, so an offline load calls it incomplete rather than loading it; the next
    load online completes (resuming a partial file where huggingface_hub keeps one)."""
    hub.cut["model.safetensors"] = 1
    hub.refuse.add("model.safetensors")
    with pytest.raises(OSError, match="failed") as info:
        mha.models.load(REPO)
    message = str(info.value)
    assert hub.url in message and str(tmp_path / "hf" / "hub") in message
    assert "never loaded" in message
    assert not (snapshot(tmp_path) / "model.safetensors").exists()
    blobs = snapshot(tmp_path).parent.parent / "blobs"
    served = set(source[1].values())
    whole = [b for b in blobs.iterdir() if not b.name.endswith(".incomplete")]
    assert len(whole) == 3 and all(b.read_bytes() in served for b in whole)
    partial = list(blobs.glob("*.incomplete"))
    kept = partial[0].stat().st_size if partial else 0

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="incomplete") as info:
        mha.models.load(REPO)
    assert "never downloads" in str(info.value) and str(snapshot(tmp_path)) in str(info.value)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.refuse.clear()
    before = len(hub.requests)
    model = mha.models.load(REPO)
    same_model(model, source[0])
    again = [r for m, p, r in hub.requests[before:]
             if m == "GET" and p.endswith("/model.safetensors")]
    assert again == [f"bytes={kept}-" if kept else None]
    assert not list(blobs.glob("*.incomplete"))


def test_offline_error_says_how_to_download(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as info:
        mha.models.load(REPO)
    message = str(info.value)
    for part in ("HF_HUB_OFFLINE is set", "never downloads", f"hf download {REPO} --include",
                 "'model-*-of-*.safetensors'", "Unset HF_HUB_OFFLINE",
                 str(tmp_path / "hf" / "hub")):
        assert part in message, part
    assert "pytorch_model.bin" not in message
    assert hub.requests == []


def test_unknown_names_and_paths(hub, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"nor a model on {hub.url}"):
        mha.models.load("someone/no-such-model")
    assert hub.requests                                 # the Hub was asked
    count = len(hub.requests)
    for path in ("no/such/folder", str(tmp_path / "missing"), "./missing", "a--b/c"):
        with pytest.raises(FileNotFoundError, match="not a model folder"):
            mha.models.load(path)
    assert len(hub.requests) == count                   # paths are never looked up


def test_a_hub_model_without_safetensors_says_so(hub, source):
    hub.files["someone/pickled"] = {k: v for k, v in source[1].items()
                                    if k != "model.safetensors"}
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        mha.models.load("someone/pickled")
    assert hub.served("GET", "pytorch_model.bin") == 0


def test_download_without_huggingface_hub_says_how_to_install(hub, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModuleNotFoundError, match="pip install huggingface_hub"):
        mha.models.load(REPO)
    assert hub.requests == []


def test_the_cache_is_read_without_huggingface_hub(hub, source, tmp_path, monkeypatch):
    mha.models.load(REPO)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    same_model(mha.models.load(REPO), source[0])


def test_the_guard_refuses_the_internet(hub):
    """The fixture's guard holds: a connection to a public address fails before any packet."""
    with socket.socket() as sock, pytest.raises(AssertionError, match="tried to reach"):
        sock.connect(("93.184.216.34", 443))
    with pytest.raises(AssertionError, match="tried to look up"):
        socket.getaddrinfo("huggingface.co", 443)
    assert os.environ["HF_ENDPOINT"].startswith("http://127.0.0.1:")
    assert Path(os.environ["HF_HOME"]).parent.exists()
