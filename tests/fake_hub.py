"""A stand-in for the Hugging Face Hub HTTP API, for tests that upload with the real `huggingface_hub` client.

Serves what `HfApi.create_repo`, `create_branch` and `upload_folder` (huggingface_hub 2.4) send, on 127.0.0.1
in a daemon thread; every committed file is kept in memory, byte for byte. Every request needs the token.

    POST /api/repos/create                                 create_repo (409 if it exists)
    POST /api/{type}s/{org}/{name}/branch/{branch}         create_branch (409 if it exists)
    POST /api/{type}s/{org}/{name}/preupload/{revision}    uploadMode "regular" for every file, and the stored
                                                           file's git oid: the client skips unchanged files
    POST /api/{type}s/{org}/{name}/commit/{revision}       NDJSON: a header line, then base64 "file" lines
    GET  /api/{type}s/{org}/{name}[/revision/{revision}]   repo_info (the client asks it after a no-op upload)
    POST /api/validate-yaml                                README.md metadata check: always fine

Errors as the Hub sends them: JSON {"error": ...} and an X-Error-Message header (X-Error-Code RepoNotFound /
RevisionNotFound on 404). Not served: LFS and xet uploads (every file is "regular", so the client takes neither
path), deletions, copies, pull requests, file listings, downloads.

Use `HfApi(endpoint=hub.url, token=hub.token)`: huggingface_hub reads HF_ENDPOINT only once, at import. It reads
HF_HUB_OFFLINE at import too (tests/conftest.py sets it): patch `huggingface_hub.constants.HF_HUB_OFFLINE` to
False in the test, or every request fails with OfflineModeIsEnabled before it leaves.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_REPO = re.compile(r"^/api/(model|dataset|space)s/([^/]+/[^/]+?)(?:/(branch|preupload|commit|revision)/(.+))?$")


def _git_oid(data: bytes) -> str:  # what the Hub reports as a regular file's oid
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self, token: str = "hf_fake_token"):
        self.token = token
        self.repos: dict[str, dict] = {}  # repo_id -> {"type", "private", "revisions": {rev: {path: bytes}}, "commits"}
        self.requests: list[tuple[str, str]] = []  # (method, path without the query)
        self.reject_commits = False  # True: every commit gets 403, as for a token without write access
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (and POST, below)
                hub._serve(self)

            do_POST = do_GET

            def log_message(self, *args):  # keep test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _repo_url(self, kind: str, repo_id: str) -> str:
        return f"{self.url}/{'' if kind == 'model' else kind + 's/'}{repo_id}"

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        method, (path, query) = h.command, urlsplit(h.path)[2:4]
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        body = gzip.decompress(body) if h.headers.get("Content-Encoding") == "gzip" else body  # 2.4 never gzips
        with self._lock:
            self.requests.append((method, path))
            if h.headers.get("Authorization") != f"Bearer {self.token}":
                status, data, code = 401, {"error": "Invalid credentials in Authorization header"}, None
            else:
                try:
                    status, data, code = self._route(method, path, body, "create_pr=1" in query)
                except Exception as e:  # a payload this fake does not understand: say so (a 5xx would be retried)
                    status, data, code = 400, {"error": f"FakeHub could not handle {method} {path}: {e!r}"}, None
        payload = json.dumps(data).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        if status >= 400:
            h.send_header("X-Error-Message", data["error"])
            if code:
                h.send_header("X-Error-Code", code)
        h.end_headers()
        h.wfile.write(payload)

    def _route(self, method: str, path: str, body: bytes, create_pr: bool) -> tuple[int, dict, str | None]:
        if method == "POST" and path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}, None
        if method == "POST" and path == "/api/repos/create":
            req = json.loads(body)
            repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            kind = req.get("type") or "model"
            url = self._repo_url(kind, repo_id)
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": url}, None
            self.repos[repo_id] = {"type": kind, "private": req.get("visibility") == "private",
                                   "revisions": {"main": {}}, "commits": []}
            return 200, {"url": url, "name": repo_id}, None
        m = _REPO.match(path)
        if not m:
            return 404, {"error": f"Not served by FakeHub: {method} {path}"}, None
        kind, repo_id, action, revision = m.group(1), m.group(2), m.group(3), unquote(m.group(4) or "main")
        repo = self.repos.get(repo_id)
        if repo is None or repo["type"] != kind:
            return 404, {"error": "Repository not found"}, "RepoNotFound"
        if action == "branch":
            if revision in repo["revisions"]:
                return 409, {"error": "Reference already exists"}, None
            start = json.loads(body or b"{}").get("startingPoint") or "main"
            repo["revisions"][revision] = dict(repo["revisions"][start])
            return 200, {}, None
        if revision not in repo["revisions"]:
            return 404, {"error": f"Invalid rev id: {revision}"}, "RevisionNotFound"
        if create_pr:
            return 400, {"error": "FakeHub does not serve pull requests"}, None
        files = repo["revisions"][revision]
        if method == "GET" and action in (None, "revision"):
            head = [c["oid"] for c in repo["commits"] if c["revision"] == revision] or ["0" * 40]
            return 200, {"id": repo_id, "private": repo["private"], "sha": head[-1],
                         "siblings": [{"rfilename": p} for p in sorted(files)]}, None
        if method == "POST" and action == "preupload":
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                    "oid": _git_oid(files[f["path"]]) if f["path"] in files else None}
                                   for f in json.loads(body)["files"]]}, None
        if method == "POST" and action == "commit":
            if self.reject_commits:
                return 403, {"error": "You don't have the rights to create a commit in this repo"}, None
            header, *ops = [json.loads(line) for line in body.splitlines() if line.strip()]
            if any(op["key"] != "file" or op["value"].get("encoding") != "base64" for op in ops):
                return 400, {"error": "FakeHub only takes base64 'file' lines (no LFS, deletions or copies)"}, None
            for op in ops:
                files[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
            oid = hashlib.sha1(f"{repo_id}@{revision}#{len(repo['commits'])}".encode()).hexdigest()
            repo["commits"].append({"revision": revision, "message": header["value"]["summary"], "oid": oid,
                                    "description": header["value"].get("description", ""),
                                    "paths": [op["value"]["path"] for op in ops]})
            return 200, {"success": True, "commitOid": oid, "pullRequestUrl": None,
                         "commitUrl": f"{self._repo_url(kind, repo_id)}/commit/{oid}"}, None
        return 404, {"error": f"Not served by FakeHub: {method} {path}"}, None
