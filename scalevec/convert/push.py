"""Publishing a checkpoint folder to the Hugging Face Hub (`scalevec-convert push DIR REPO_ID`).

The token comes only from the `token` argument, `HF_TOKEN` or the huggingface_hub login. It is never printed,
logged or written, and every error raised here is scrubbed of it, because error messages end up in CI logs.
"""

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects, validate_repo_id


class PushError(Exception):
    """Publishing failed. The message says which step failed and never contains the token."""


@dataclass(frozen=True)
class PushResult:
    repo_id: str
    revision: str
    private: bool
    files: list[tuple[str, int]]  # (path in the repository, size in bytes), in upload order
    dry_run: bool
    commit_sha: str | None = None  # None for a dry run
    commit_url: str | None = None


def files_to_upload(folder: Path) -> list[tuple[str, int]]:
    """The files `upload_folder` sends, selected the way it selects them (`.git/` and its cache left out)."""
    paths = {path.relative_to(folder).as_posix(): path for path in sorted(folder.glob("**/*")) if path.is_file()}
    selected = filter_repo_objects(paths, ignore_patterns=DEFAULT_IGNORE_PATTERNS)
    return [(name, paths[name].stat().st_size) for name in selected]


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
) -> PushResult:
    """Create `repo_id` if needed (private if asked), create branch `revision` from main if it does not exist,
    and upload every file of `folder` (one commit, unless the folder has hundreds of files). `dry_run` only lists
    the files; it contacts nothing."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(str(error)) from None
    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder} is not a folder: nothing to push.")
    files = files_to_upload(folder)
    if not files:
        raise PushError(f"{folder} holds no file to upload.")
    result = PushResult(repo_id, revision or "main", private, files, dry_run)
    if dry_run:
        return result

    token = token or get_token()
    if token is None:  # every write needs a token; refuse before sending anything, a private repo above all
        raise PushError(
            f"No Hugging Face token found, so {repo_id} ({'private' if private else 'public'}) cannot be created or "
            "written. Set HF_TOKEN or run `hf auth login`. Nothing was sent."
        )
    api = HfApi(token=token)
    with _failing_step("repository creation", repo_id, token):
        api.create_repo(repo_id, private=private, exist_ok=True)
        already_public = private and not api.repo_info(repo_id).private
    if already_public:  # create_repo(exist_ok=True) keeps an existing repo's visibility
        raise PushError(
            f"{repo_id} exists and is public, and --private does not change that: nothing was uploaded. Make it "
            "private on the Hub first, or push without --private."
        )
    if result.revision != "main":
        with _failing_step(f"creation of branch {result.revision!r}", repo_id, token):
            api.create_branch(repo_id, branch=result.revision, exist_ok=True)
    with _failing_step("upload", repo_id, token):
        commit = api.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            revision=result.revision,
            commit_message=commit_message or f"Upload {folder.name} with scalevec-convert",
        )
    return replace(result, commit_sha=commit.oid, commit_url=commit.commit_url)


@contextmanager
def _failing_step(step: str, repo_id: str, token: str) -> Iterator[None]:
    """Turn any failure of `step` into a PushError that names the step and the likely cause, without the token."""
    try:
        yield
    except Exception as error:
        response = error.response if isinstance(error, HfHubHTTPError) else None
        if response is None:
            cause = type(error).__name__  # e.g. ConnectError: the Hub was not reached
        elif response.status_code in (401, 403):
            cause = "authentication failed: the token is wrong, expired or lacks write access to this namespace"
        else:
            cause = f"the Hub answered HTTP {response.status_code}"
        details = str(error).replace(token, "<token>")
        # `from None`: the original exception (and the request it holds) stays out of the traceback.
        raise PushError(
            f"{step.capitalize()} failed for {repo_id} ({cause}). The local folder is untouched.\n{details}"
        ) from None


def add_push_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of `scalevec-convert push`; the token is deliberately not one of them (shell history, logs)."""
    parser.add_argument("folder", metavar="DIR", type=Path, help="checkpoint folder to upload, as it is")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repository, owner/name; created if missing")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", help="branch to push to (created from main if missing); default main")
    parser.add_argument("--commit-message", help="message of the commit")
    parser.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded; send nothing")
    return parser


def run_push(args: argparse.Namespace) -> int:
    """Run `scalevec-convert push` with parsed `args`; returns the exit status."""
    try:
        result = push_folder(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            dry_run=args.dry_run,
        )
    except PushError as error:
        print(f"scalevec-convert: error: {error}", file=sys.stderr)  # as the other subcommands say it
        return 1
    total = sum(size for _, size in result.files)
    verb = "Would upload" if result.dry_run else "Uploaded"
    print(f"{verb} {len(result.files)} files ({total} bytes) to {result.repo_id} at revision {result.revision}:")
    for path, size in result.files:
        print(f"  {path}  ({size} bytes)")
    if not result.dry_run:
        print(f"Commit {result.commit_sha}: {result.commit_url}")
    return 0
