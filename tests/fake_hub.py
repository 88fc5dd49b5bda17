"""A model repository served over HTTP from a local directory, as the hub serves it to huggingface_hub:
`HEAD`/`GET /<repo>/resolve/<revision>/<file>` with the headers `hf_hub_download` reads (`X-Repo-Commit`,
`ETag`, `X-Linked-Etag`/`X-Linked-Size` for weight files, which the hub keeps in LFS), byte ranges, and
`404` with `X-Error-Code` for what the repository lacks. `hold` names files whose body is held back
until `release` is set (at most `hold_s` seconds), so a test can see what a load does while a shard is still
arriving; `released` says, for each held file, whether `release` was set before the body went out."""

from __future__ import annotations

import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

LFS_SUFFIXES = (".safetensors", ".bin")


class _Server(ThreadingHTTPServer):
    # A load asks for several files at once: with socketserver's backlog of 5, a busy machine (CI running tests
    # beside) resets connections, and huggingface_hub's retry downloads a file twice.
    request_queue_size = 128


class FakeHub:
    def __init__(self, repo_id: str, directory: str, commit: str = "a" * 40, revisions: tuple[str, ...] = ("main",)):
        self.repo_id, self.directory, self.commit, self.revisions = repo_id, directory, commit, revisions
        self.hold: set[str] = set()
        self.fail: set[str] = set()  # files answered with 403 Forbidden
        self.release = threading.Event()
        self.hold_s = 30.0
        self.released: dict[str, bool] = {}
        self.served: list[str] = []  # files whose body was sent, in order
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                hub.requests.append((self.command, self.path))
                prefix = f"/{hub.repo_id}/resolve/"
                path = unquote(self.path.split("?")[0])
                if not path.startswith(prefix):
                    return self._error(404, "RepoNotFound")
                revision, _, filename = path[len(prefix) :].partition("/")
                if revision not in (*hub.revisions, hub.commit):
                    return self._error(404, "RevisionNotFound")
                if filename in hub.fail:
                    return self._error(403, "Forbidden")
                full = os.path.join(hub.directory, filename)
                if not os.path.isfile(full):
                    return self._error(404, "EntryNotFound")
                with open(full, "rb") as f:
                    data = f.read()
                start, end = 0, len(data)
                if self.headers.get("Range", "").startswith("bytes="):
                    a, _, b = self.headers["Range"][6:].partition("-")
                    start, end = int(a), min(int(b) + 1 if b else len(data), len(data))
                self.send_response(206 if (start, end) != (0, len(data)) else 200)
                self.send_header("X-Repo-Commit", hub.commit)
                if filename.endswith(LFS_SUFFIXES):
                    sha = hashlib.sha256(data).hexdigest()
                    self.send_header("ETag", f'"{sha}"')
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                else:
                    self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
                self.send_header("Content-Length", str(end - start))
                self.end_headers()
                if body:
                    if filename in hub.hold:
                        hub.released[filename] = hub.release.wait(hub.hold_s)
                    self.wfile.write(data[start:end])
                    hub.served.append(filename)

            def _error(self, code: int, error: str):
                self.send_response(code)
                self.send_header("X-Error-Code", error)
                self.send_header("X-Repo-Commit", hub.commit) if error == "EntryNotFound" else None
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
