"""Finding GGUF models on Hugging Face: search, a repository's files, the curated list.

The protocol is `huggingface_hub`'s; this module turns its answers into what a person
chooses from (one `ModelChoice` per quantization file, a split model's parts as one)
and its exceptions into readable `HubError`s.  Nothing here runs at import or start-up:
the network is touched only when `search` or `list_repo` is called.  The endpoint is
`HF_ENDPOINT` (read at call time, so tests can point it at a local server).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar
from urllib.parse import urlsplit

import platformdirs

from backend.errors import HubAccessDenied, HubError, HubNotFound, HubUnreachable, UnsafeHubAnswer
from backend.models.hf_cache import check_commit, check_file_name, check_repo_id, check_sha256, printable
from backend.private_files import PRIVATE_DIR_MODE
from backend.settings import APP_NAME

__all__ = [
    "DEFAULT_QUANT_PREFERENCE",
    "CuratedModel",
    "HubFile",
    "ModelChoice",
    "RepoListing",
    "RepoSummary",
    "auth_headers",
    "check_choice",
    "curated_models",
    "current_token",
    "forget_token",
    "hub_endpoint",
    "is_on_endpoint",
    "list_repo",
    "parse_pull_target",
    "pick_choice",
    "quantization_of",
    "save_token",
    "search",
    "token_for",
    "token_path",
    "translate_hub_error",
]

DEFAULT_ENDPOINT = "https://huggingface.co"
# What `pull REPO` takes when no quantization is named: llama.cpp's own `-hf` default
# first, then the usual good trade-offs, smallest loss first.
DEFAULT_QUANT_PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q4_0", "Q6_K", "Q8_0", "MXFP4", "F16")
SORTS = {"downloads": "downloads", "recent": "lastModified", "likes": "likes"}
SEARCH_TIMEOUT = 15.0  # seconds


@dataclass(frozen=True)
class RepoSummary:
    repo_id: str
    downloads: int
    likes: int
    last_modified: str  # ISO date, "" when the hub did not say
    gated: bool


@dataclass(frozen=True)
class HubFile:
    path: str  # inside the repository
    size: int
    sha256: str  # the LFS SHA-256 the repository publishes; "" for non-LFS files


@dataclass(frozen=True)
class ModelChoice:
    """One loadable model of a repository: a GGUF file, or all parts of a split one."""

    repo_id: str
    name: str  # the file name without .gguf and without the split suffix
    quant: str  # e.g. Q4_K_M; "" when the name does not say
    files: tuple[HubFile, ...]  # parts in order; the first is the one llama-server opens

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def first_file(self) -> str:
        return self.files[0].path


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    commit: str  # the revision every file is downloaded from, so parts never mix
    choices: tuple[ModelChoice, ...]
    gguf_metadata: dict[str, Any] = field(default_factory=dict)  # the hub's own header summary
    gated: bool = False

    def by_quant(self) -> dict[str, list[ModelChoice]]:
        grouped: dict[str, list[ModelChoice]] = {}
        for choice in self.choices:
            grouped.setdefault(choice.quant or "other", []).append(choice)
        return grouped


@dataclass(frozen=True)
class CuratedModel:
    name: str
    repo_id: str
    size: str  # "small", "medium", "large": a hint, the badge gives the numbers
    note: str = ""


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def search(text: str, *, sort: str = "downloads", limit: int = 30,
           token: str | None = None) -> list[RepoSummary]:
    """GGUF repositories matching `text`, most downloaded (or most recent) first."""
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils._http import get_session, hf_raise_for_status

    # One GET through huggingface_hub's session and error mapping, not `HfApi.list_models`:
    # that one retries a refused connection five times with backoff, 23 s before an
    # offline machine hears that it is offline.
    params: list[tuple[str, str | int | float | bool | None]] = [
        ("filter", "gguf"), ("sort", SORTS.get(sort, sort)), ("direction", "-1"), ("limit", limit)]
    params += [("expand", key) for key in ("downloads", "likes", "lastModified", "gated")]
    if text.strip():
        params.append(("search", text.strip()))

    def fetch() -> list[dict[str, Any]]:
        url = f"{hub_endpoint()}/api/models"
        response = get_session().get(url, params=params, timeout=SEARCH_TIMEOUT,
                                     headers={**build_hf_headers(token=False), **auth_headers(url, token)})
        hf_raise_for_status(response)
        found = response.json()
        return found if isinstance(found, list) else []

    found = _hub_call(fetch, f"the search for “{text}”")
    # Only what could be listed and downloaded: a hub's junk entries are left out.
    return [RepoSummary(repo_id=str(m.get("id") or m.get("modelId")), downloads=_count(m.get("downloads")),
                        likes=_count(m.get("likes")), last_modified=_date(m.get("lastModified")),
                        gated=bool(m.get("gated")))
            for m in found if isinstance(m, dict) and _is_repo_id(m.get("id") or m.get("modelId"))]


def list_repo(repo_id: str, *, token: str | None = None) -> RepoListing:
    """A repository's GGUF models with sizes and published SHA-256s, at its current commit."""
    from huggingface_hub.hf_api import HfApi

    repo_id = check_repo_id(repo_id.strip())
    endpoint = hub_endpoint()
    api = HfApi(endpoint=endpoint, token=token_for(endpoint, token) or False)
    info = _hub_call(lambda: api.model_info(repo_id, files_metadata=True), repo_id)
    files = [HubFile(str(s.rfilename), _count(s.size) or (_count(s.lfs.size) if s.lfs else 0),
                     str(s.lfs.sha256 if s.lfs else "") or "")
             for s in (info.siblings or [])]
    gguf: dict[str, Any] = info.gguf if isinstance(info.gguf, dict) else {}
    choices = tuple(group_choices(repo_id, files))
    commit = check_commit(str(info.sha or ""))
    for choice in choices:
        check_choice(choice)
    return RepoListing(repo_id=repo_id, commit=commit, choices=choices, gguf_metadata=gguf,
                       gated=bool(info.gated))


def check_choice(choice: ModelChoice) -> ModelChoice:
    """`choice` as far as a hub said it: a repository id, file names and SHA-256s that can
    name nothing outside the cache (raises `UnsafeHubAnswer` otherwise)."""
    check_repo_id(choice.repo_id)
    for f in choice.files:
        check_file_name(f.path)
        if f.sha256:
            check_sha256(f.sha256)
        if not isinstance(f.size, int) or f.size < 0:
            raise UnsafeHubAnswer(f"Hugging Face announced a size of {f.size!r} for a file; refused.")
    return choice


def group_choices(repo_id: str, files: Iterable[HubFile]) -> list[ModelChoice]:
    """GGUF models among `files`; split parts become one choice; projectors are left out."""
    singles: list[ModelChoice] = []
    splits: dict[tuple[str, int], dict[int, HubFile]] = {}
    for f in files:
        base = f.path.rsplit("/", 1)[-1]
        lowered = base.lower()
        if not lowered.endswith(".gguf") or lowered.startswith("mmproj") or "-mmproj" in lowered:
            continue
        part = _SPLIT.search(f.path)
        if part:
            splits.setdefault((f.path[: part.start()], int(part.group(2))), {})[int(part.group(1))] = f
        else:
            singles.append(ModelChoice(repo_id, base[:-5], quantization_of(base), (f,)))
    for (stem, count), parts in splits.items():
        if sorted(parts) != list(range(1, count + 1)):
            continue  # an incomplete split cannot be loaded
        name = stem.rsplit("/", 1)[-1]
        singles.append(ModelChoice(repo_id, name, quantization_of(name + ".gguf"),
                                   tuple(parts[i] for i in range(1, count + 1))))
    singles.sort(key=lambda c: (c.size, c.name))
    return singles


def quantization_of(file_name: str) -> str:
    """The quantization a GGUF file name states, upper-cased: Q4_K_M, IQ2_XXS, F16..."""
    stem = _SPLIT.sub("", file_name.rsplit("/", 1)[-1])
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else ""


def parse_pull_target(target: str) -> tuple[str, str]:
    """`REPO[:QUANT|FILE]` -> (repo, selector); the selector is "" when none is given."""
    repo, _, selector = target.strip().partition(":")
    if not _is_repo_id(repo):
        raise HubError(f"“{printable(target)}” is not a repository: write it as owner/name, "
                       "optionally followed by :QUANT or :FILE.")
    return repo, selector.strip()


def pick_choice(listing: RepoListing, selector: str = "") -> ModelChoice:
    """The model `selector` names (a quantization or a file path); a sane default without one."""
    if not listing.choices:
        raise HubNotFound(f"{listing.repo_id} has no GGUF model files.")
    if selector:
        lowered = selector.lower()
        for choice in listing.choices:
            if any(f.path.lower() == lowered or f.path.rsplit("/", 1)[-1].lower() == lowered
                   for f in choice.files):
                return choice
        matching = [c for c in listing.choices if c.quant.lower() == lowered]
        if matching:
            return matching[0]
        available = ", ".join(sorted({c.quant or c.name for c in listing.choices}))
        raise HubNotFound(f"{listing.repo_id} has no “{selector}”. Available: {available}.")
    for quant in DEFAULT_QUANT_PREFERENCE:
        for choice in listing.choices:
            if choice.quant == quant:
                return choice
    return listing.choices[0]


def curated_models() -> list[CuratedModel]:
    """The short list of good coding-agent models shipped with the app (package data)."""
    text = resources.files("backend").joinpath("data/curated_models.json").read_text("utf-8")
    return [CuratedModel(**entry) for entry in json.loads(text)["models"]]


# --- the token for gated repositories ------------------------------------------------------


def token_for(url: str, token: str | None = None) -> str | None:
    """The token to send with a request to `url`, or None when it must not go there.

    It goes only to the endpoint's own scheme, host and port (a redirect to a CDN or any
    other host gets none, as huggingface_hub's own downloads do), and never over plain
    http:// unless the endpoint is this machine: on a café network a plain-http mirror is
    one spoofed answer away from someone else.  `token` defaults to `HF_TOKEN`, the one
    saved here, then the login of Hugging Face's own tools.
    """
    endpoint = urlsplit(hub_endpoint())
    if not is_on_endpoint(url):
        return None
    if endpoint.scheme != "https" and not _is_loopback(endpoint.hostname or ""):
        return None
    if token:
        return token
    from huggingface_hub import get_token

    return current_token() or get_token()


def is_on_endpoint(url: str) -> bool:
    """Whether `url` has the endpoint's scheme, host and port."""
    return _origin(urlsplit(url)) == _origin(urlsplit(hub_endpoint()))


def auth_headers(url: str, token: str | None = None) -> dict[str, str]:
    """{"authorization": ...} for a request to `url` when `token_for` lets the token go there."""
    chosen = token_for(url, token)
    return {"authorization": f"Bearer {chosen}"} if chosen else {}



def token_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "hf_token"


def current_token() -> str | None:
    """`HF_TOKEN` from the environment, else the one saved here; None lets the library
    fall back to a login made with Hugging Face's own tools."""
    env = os.environ.get("HF_TOKEN", "").strip()
    if env:
        return env
    try:
        saved = token_path().read_text().strip()
    except OSError:
        return None
    return saved or None


def save_token(token: str) -> Path:
    """Keep `token` readable by this user only (0600), written atomically."""
    path = token_path()
    path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token.strip() + "\n")
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a file left by an earlier try
    os.replace(tmp, path)
    return path


def forget_token() -> None:
    token_path().unlink(missing_ok=True)


# --- errors ---------------------------------------------------------------------------------

T = TypeVar("T")


def translate_hub_error(exc: BaseException, what: str) -> HubError:
    """A sentence for `exc`, raised while working on `what` (a repository or a search)."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, HubError):
        return exc
    if isinstance(exc, GatedRepoError):
        return HubAccessDenied(f"{what} is gated: accept its terms on Hugging Face, then set "
                               "HF_TOKEN or save a token that has access.")
    if isinstance(exc, RemoteEntryNotFoundError):
        return HubNotFound(f"That file is no longer in {what}.")
    if isinstance(exc, RevisionNotFoundError):
        return HubNotFound(f"That revision of {what} does not exist.")
    if isinstance(exc, RepositoryNotFoundError):
        return HubNotFound(f"No repository {what} on Hugging Face (if it is private, "
                           "a token with access is needed).")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403):
            return HubAccessDenied(f"Hugging Face refused access to {what} (HTTP {status}): "
                                   "set HF_TOKEN or save a token that has access.")
        if status == 404:
            return HubNotFound(f"Hugging Face has nothing at {what}.")
        return HubError(f"Hugging Face answered HTTP {status} for {what}; try again later.")
    if isinstance(exc, (OfflineModeIsEnabled, httpx2.TransportError)):
        return HubUnreachable("Hugging Face cannot be reached: check the network connection "
                              "(or HF_ENDPOINT) and try again.")
    return HubError(f"Talking to Hugging Face about {what} failed: {exc or type(exc).__name__}.")


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _date(value: Any) -> str:
    return printable(value, 40) if isinstance(value, str) else ""


def _is_repo_id(value: Any) -> bool:
    try:
        check_repo_id(value)
    except UnsafeHubAnswer:
        return False
    return True


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: Any) -> tuple[str, str, int]:
    try:
        port = url.port
    except ValueError:
        port = -1
    return (url.scheme.lower(), (url.hostname or "").lower(), port or _DEFAULT_PORTS.get(url.scheme.lower(), 0))


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hub_call(fn: Callable[[], T], what: str) -> T:
    try:
        return fn()
    except HubError:
        raise
    except Exception as exc:
        raise translate_hub_error(exc, what) from exc


_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])("
    r"I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|F16|F32|FP16|FP32"
    r")(?![A-Za-z0-9])", re.IGNORECASE)
