"""Where pushes go: the Hugging Face Hub (through ``huggingface_hub.HfApi``) or any pyarrow filesystem.

A target has ``create()`` (make the repository, checked on the driver before any worker starts) and
``upload(folder, path_in_repo, message, revision, ignore_patterns)`` (one commit of a local folder).
Targets hold the token privately: it is passed to each call and never logged, shown or written.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import time

from raytrainer.storage import Storage

MANIFEST = "manifest.json"


def scrub(text: str, token: str | None) -> str:
    """``text`` with the token replaced, for messages that may quote a request."""
    return text.replace(token, "<HUB_TOKEN>") if token else text


def local_files(folder: str, ignore_patterns: list[str] | None = None) -> list[str]:
    """Relative paths (with /) of the files under ``folder``, minus those matching an ignore pattern
    (fnmatch on the relative path, as huggingface_hub does: ``checkpoint-*`` skips whole folders)."""
    out = []
    for root, _dirs, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if not any(fnmatch.fnmatch(rel, p) for p in ignore_patterns or []):
                out.append(rel)
    return sorted(out)


class HuggingFaceTarget:
    """A model repository on the Hugging Face Hub (or a Hub-compatible endpoint, ``HF_ENDPOINT``)."""

    def __init__(self, repo_id: str, token: str, private: bool | None = None):
        from huggingface_hub import HfApi

        self.api = HfApi()
        self.repo_id = repo_id
        self.private = private
        self._token = token

    @property
    def name(self) -> str:
        return f"hf://{self.repo_id}"

    def scrub(self, text: str) -> str:
        return scrub(text, self._token)

    def create(self, revision: str | None = None) -> None:
        url = self.api.create_repo(self.repo_id, token=self._token, private=self.private, exist_ok=True)
        self.repo_id = url.repo_id  # the full "user/name" when only a name was given
        if revision:
            self.api.create_branch(self.repo_id, branch=revision, token=self._token, exist_ok=True)

    def upload(self, folder: str, path_in_repo: str, message: str, revision: str | None,
               ignore_patterns: list[str] | None = None):
        return self.api.upload_folder(repo_id=self.repo_id, folder_path=folder,
                                      path_in_repo=path_in_repo or None, commit_message=message,
                                      token=self._token, revision=revision, ignore_patterns=ignore_patterns)

    def __repr__(self) -> str:
        return f"HuggingFaceTarget({self.repo_id!r})"


class FilesystemTarget:
    """A plain model repository on a pyarrow filesystem (``file://``, ``s3://``, ``gs://``, ...).

    Layout: one folder per revision (``main`` unless ``hub_revision`` names another), holding the files
    as a Hub repository would; ``commits.json`` beside them lists every push (revision, folder, message,
    files, time). A checkpoint's ``manifest.json`` is removed first and written last, so a reader never
    takes a half-replaced ``last-checkpoint`` for a committed one.
    """

    def __init__(self, uri: str, filesystem=None):
        self.storage = Storage.from_uri(uri, filesystem)
        self.uri = self.storage.uri

    @property
    def name(self) -> str:
        return self.uri

    def scrub(self, text: str) -> str:
        return text

    def revision_uri(self, revision: str | None = None, path_in_repo: str = "") -> str:
        return self.storage.uri_of(*[p for p in (revision or "main", path_in_repo) if p])

    def create(self, revision: str | None = None) -> None:
        self.storage.check_writable("hub_model_id")

    def upload(self, folder: str, path_in_repo: str, message: str, revision: str | None,
               ignore_patterns: list[str] | None = None) -> str:
        dest = self.storage.path(*[p for p in (revision or "main", path_in_repo) if p])
        files = local_files(folder, ignore_patterns)
        if MANIFEST in files:
            if self.storage.exists(posixpath.join(dest, MANIFEST)):
                self.storage.fs.delete_file(posixpath.join(dest, MANIFEST))
            files = [f for f in files if f != MANIFEST] + [MANIFEST]
        for rel in files:  # streamed: a model's files never sit whole in the driver's memory
            self.storage.upload_file(os.path.join(folder, rel), posixpath.join(dest, rel))
        self._log_commit({"revision": revision or "main", "path_in_repo": path_in_repo, "message": message,
                          "files": files, "time": time.time()})
        return self.revision_uri(revision, path_in_repo)

    def commits(self) -> list[dict]:
        path = self.storage.path("commits.json")
        return json.loads(self.storage.read_bytes(path)) if self.storage.exists(path) else []

    def _log_commit(self, entry: dict) -> None:  # pushes to one target run one at a time (HubPusher)
        self.storage.write_atomic(self.storage.path("commits.json"),
                                  json.dumps([*self.commits(), entry], indent=1).encode())

    def __repr__(self) -> str:
        return f"FilesystemTarget({self.uri!r})"


def target_for(args, token: str | None = None):
    """The target ``args`` name: a URI in ``hub_model_id`` is a filesystem repository, anything else a Hub
    repo id (``output_dir``'s name when unset, as in HF). Raises, naming the fix, when no token is found."""
    model_id = args.hub_model_id
    if model_id and "://" in model_id:
        return FilesystemTarget(model_id, args.storage_filesystem)
    import huggingface_hub

    token = token or args.hub_token or huggingface_hub.get_token()
    if not token:
        raise ValueError(
            "push_to_hub=True pushes to the Hugging Face Hub, which needs a token: set HF_TOKEN, pass "
            "hub_token, or run `hf auth login`. To push to a folder or bucket instead, give a URI as "
            "hub_model_id (e.g. file:///data/models/my-model or s3://bucket/models/my-model)."
        )
    repo_id = model_id or os.path.basename(os.path.abspath(args.output_dir).rstrip("/"))
    return HuggingFaceTarget(repo_id, token, args.hub_private_repo)
