"""Finding GGUF models on Hugging Face: search, a repository's files, the curated list.

The protocol is `huggingface_hub`'s; this module turns its answers into what a person
chooses from (one `ModelChoice` per quantization file, a split model's parts as one)
and its exceptions into readable `HubError`s.  Nothing here runs at import or start-up:
the network is touched only when `search` or `list_repo` is called.  The endpoint is
`HF_ENDPOINT` (read at call time, so tests can point it at a local server).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import platformdirs

from backend.errors import HubAccessDenied, HubError, HubNotFound, HubUnreachable
from backend.settings import APP_NAME

__all__ = [
    "DEFAULT_QUANT_PREFERENCE",
    "CuratedModel",
    "HubFile",
    "ModelChoice",
    "RepoListing",
    "RepoSummary",
    "curated_models",
    "current_token",
    "forget_token",
    "hub_endpoint",
    "list_repo",
    "parse_pull_target",
    "pick_choice",
    "quantization_of",
    "save_token",
    "search",
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
        response = get_session().get(f"{hub_endpoint()}/api/models", params=params, timeout=SEARCH_TIMEOUT,
                                     headers=build_hf_headers(token=token or current_token()))
        hf_raise_for_status(response)
        return response.json()

    found = _hub_call(fetch, f"the search for “{text}”")
    return [RepoSummary(repo_id=str(m.get("id") or m.get("modelId")), downloads=_count(m.get("downloads")),
                        likes=_count(m.get("likes")), last_modified=str(m.get("lastModified") or ""),
                        gated=bool(m.get("gated"))) for m in found if isinstance(m, dict)]


def list_repo(repo_id: str, *, token: str | None = None) -> RepoListing:
    """A repository's GGUF models with sizes and published SHA-256s, at its current commit."""
    from huggingface_hub.hf_api import HfApi

    repo_id = repo_id.strip()
    api = HfApi(endpoint=hub_endpoint(), token=token or current_token())
    info = _hub_call(lambda: api.model_info(repo_id, files_metadata=True), repo_id)
    files = [HubFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                     (s.lfs.sha256 if s.lfs else "") or "")
             for s in (info.siblings or [])]
    gguf: dict[str, Any] = info.gguf if isinstance(info.gguf, dict) else {}
    return RepoListing(repo_id=repo_id, commit=info.sha or "main",
                       choices=tuple(group_choices(repo_id, files)), gguf_metadata=gguf,
                       gated=bool(info.gated))


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
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise HubError(f"“{target}” is not a repository: write it as owner/name, "
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
    path.parent.mkdir(parents=True, exist_ok=True)
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
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


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
