"""A Hub-protocol HTTP server on loopback, for the tests: no public Hub is reachable here.

It implements the part of the Hugging Face Hub API that `huggingface_hub` 2.4 calls for `create_repo`,
`create_branch`, `upload_folder` / `create_commit` (preupload, then an NDJSON commit with every file inline:
the server answers `uploadMode: "regular"`, so neither Xet nor LFS is needed, also with `hf_xet` installed),
`model_info`, `list_repo_tree` / `list_repo_files` and file download (`HEAD` / `GET /resolve`), which is
what `snapshot_download` and `from_pretrained` use. Standard library only; repositories live in memory.

Authentication is the Hub's: one valid token; writes need it, private repositories are invisible without it
(401 with `X-Error-Code: RepoNotFound`), a wrong token is refused everywhere ("Invalid credentials in
Authorization header"). Every request is recorded in `requests`, and `faults[route] = status` makes a route
fail, so that tests can check what a client sent and how it handles a failing Hub.
"""

import base64
import hashlib
import json
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

TEST_TOKEN = "hf_SENTINELvalidTestToken0123456789abcdef"

REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [  # (methods, path pattern, handler name); matched on the still-quoted path, so "%2F" stays in a segment
    ({"POST"}, r"/api/repos/create", "create_repo"),
    ({"POST"}, r"/api/validate-yaml", "validate_yaml"),
    ({"POST"}, rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ({"POST"}, rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ({"POST"}, rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)", "create_branch"),
    ({"GET"}, rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", "model_info"),
    ({"GET"}, rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "tree"),
    ({"GET", "HEAD"}, rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]


def git_blob_id(content: bytes) -> str:
    """The git object id of a file: what the Hub calls a regular file's `oid` and what the client compares."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubError(Exception):
    """An error answer as the Hub gives it: the message in the body and in `X-Error-Message`, the kind of error in
    `X-Error-Code` (which huggingface_hub turns into RepositoryNotFoundError, RevisionNotFoundError, ...)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **fields):
        super().__init__(message)
        self.status, self.fields = status, fields
        self.headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}


@dataclass
class Repo:
    private: bool
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> {path: content}
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    messages: dict[str, str] = field(default_factory=dict)  # commit sha -> commit message

    def add_commit(self, files: dict[str, bytes], branch: str, message: str = "") -> str:
        sha = secrets.token_hex(20)
        self.commits[sha], self.messages[sha], self.branches[branch] = files, message, sha
        return sha

    def resolve(self, revision: str) -> str:
        sha = self.branches.get(revision, revision)
        if sha not in self.commits:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return sha


class HubServer:
    def __init__(self, token: str = TEST_TOKEN):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.faults: dict[str, int] = {}  # route name -> HTTP status that route answers until removed
        self.lock = threading.Lock()  # one request at a time: the handlers need no finer locking
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> "HubServer":
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def env(self, hf_home: Path, token: str | None = None) -> dict[str, str]:
        """Environment for a subprocess that talks to this server, with its own empty HF_HOME and no token but
        `token`: huggingface_hub reads these at import, so they must be set before the process starts."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HOME": str(hf_home),
            "HF_HUB_CACHE": str(hf_home / "hub"),
            "HF_TOKEN_PATH": str(hf_home / "token"),
            "HF_TOKEN": token or "",
            "HUGGING_FACE_HUB_TOKEN": "",
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "NO_PROXY": "127.0.0.1,localhost",
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every response carries a Content-Length

    def do_GET(self):
        self._dispatch()

    do_HEAD = do_POST = do_GET

    def log_message(self, format, *args):  # the tests read what they need from `HubServer.requests`
        pass

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.query = parse_qs(url.query)
        with self.hub.lock:
            self.hub.requests.append((self.command, url.path))
            try:
                status, payload, headers = self._handle(url.path)
            except HubError as error:
                status, payload, headers = error.status, {"error": str(error), **error.fields}, error.headers
        self._reply(status, payload, headers)

    def _handle(self, path: str) -> tuple[int, dict | list | bytes, dict[str, str]]:
        handler, params = self._route(path)
        if handler in self.hub.faults:
            raise HubError(self.hub.faults[handler], f"Injected failure of {handler}")
        try:
            return getattr(self, handler)(**params)
        except (KeyError, ValueError) as error:  # a request this server cannot read: a 400, which clients do not retry
            raise HubError(400, f"Malformed request: {error!r}") from error

    def _route(self, path: str) -> tuple[str, dict[str, str]]:
        for methods, pattern, handler in ROUTES:
            match = re.fullmatch(pattern, path)
            if match and self.command in methods:
                return handler, {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        raise HubError(404, f"No route for {self.command} {path}")

    def _reply(self, status: int, payload, headers: dict[str, str]) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header(
            "Content-Type", "application/octet-stream" if isinstance(payload, bytes) else "application/json"
        )
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    # Authentication -------------------------------------------------------------------------------------------

    def _authenticated(self) -> bool:
        header = self.headers.get("Authorization")
        if header is None:
            return False
        if header != f"Bearer {self.hub.token}":
            raise HubError(401, "Invalid credentials in Authorization header")
        return True

    def _repo(self, repo_id: str, write: bool = False) -> Repo:
        authenticated = self._authenticated()
        if write and not authenticated:
            raise HubError(401, "You must be authenticated to write to a repository", "RepoNotFound")
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not authenticated):  # the Hub hides private repos from strangers
            raise HubError(401 if not authenticated else 404, "Repository not found", "RepoNotFound")
        return repo

    # Writes ---------------------------------------------------------------------------------------------------

    def create_repo(self):
        if not self._authenticated():
            raise HubError(401, "Invalid username or password.")
        request = json.loads(self.body)
        repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
        if "/" not in repo_id:
            raise HubError(400, "This test server needs a namespace in the repo id (owner/name)")
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            raise HubError(409, "You already created this model repo", url=url)  # the client reads `url`
        repo = Repo(private=request.get("visibility", "public") == "private")
        repo.add_commit({".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}, "main")
        self.hub.repos[repo_id] = repo
        return 200, {"url": url, "name": repo_id}, {}

    def validate_yaml(self):
        return 200, {"errors": [], "warnings": []}, {}  # the real Hub checks the card metadata; tests parse it

    def create_branch(self, repo: str, rev: str):  # `rev` is the new branch
        target = self._repo(repo, write=True)
        if rev in target.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{rev}")
        start = (json.loads(self.body) if self.body else {}).get("startingPoint", "main")
        target.branches[rev] = target.resolve(start)
        return 200, {}, {}

    def preupload(self, repo: str, rev: str):
        target = self._repo(repo, write=True)
        files = target.commits[target.resolve(rev)]
        modes = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_id(files[f["path"]]) if f["path"] in files else None,
            }
            for f in json.loads(self.body)["files"]
        ]
        return 200, {"files": modes}, {}

    def commit(self, repo: str, rev: str):
        target = self._repo(repo, write=True)
        if rev not in target.branches:  # commits go onto a branch, never onto a bare commit
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        lines = [json.loads(line) for line in self.body.splitlines()]
        files = dict(target.commits[target.branches[rev]])
        for item in lines[1:]:  # the first line is the header with the commit message
            if item["key"] != "file":
                raise HubError(400, f"This test server only takes files sent inline, got {item['key']!r}")
            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        sha = target.add_commit(files, rev, message=lines[0]["value"]["summary"])
        return 200, {"commitUrl": f"{self.hub.url}/{repo}/commit/{sha}", "commitOid": sha, "success": True}, {}

    # Reads ----------------------------------------------------------------------------------------------------

    def model_info(self, repo: str, rev: str = "main"):
        target = self._repo(repo)
        sha = target.resolve(rev)
        siblings = [{"rfilename": path} for path in sorted(target.commits[sha])]
        return 200, {"id": repo, "modelId": repo, "sha": sha, "private": target.private, "siblings": siblings}, {}

    def tree(self, repo: str, rev: str, path: str = ""):
        target = self._repo(repo)
        files = target.commits[target.resolve(rev)]
        recursive = self.query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{path.strip('/')}/" if path else ""
        entries: dict[str, dict] = {}
        for name in sorted(p for p in files if p.startswith(prefix)):
            rest = name[len(prefix) :].split("/")
            folders = [prefix + "/".join(rest[:depth]) for depth in range(1, len(rest))]
            for folder in folders if recursive else folders[:1]:
                entries[folder] = {"type": "directory", "path": folder, "oid": git_blob_id(folder.encode())}
            if recursive or len(rest) == 1:
                entries[name] = {
                    "type": "file",
                    "path": name,
                    "size": len(files[name]),
                    "oid": git_blob_id(files[name]),
                }
        if prefix and not entries:
            raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound")
        return 200, list(entries.values()), {}

    def resolve(self, repo: str, rev: str, path: str):
        target = self._repo(repo)
        sha = target.resolve(rev)
        content = target.commits[sha].get(path)
        if content is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": sha})
        return 200, content, {"ETag": f'"{git_blob_id(content)}"', "X-Repo-Commit": sha}
