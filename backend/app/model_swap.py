"""What loading or unloading a model means for the people and agents using the port, asked
before it happens.

The window's Load used to replace the default model at once: a teammate's agent set up
with `default` (as the Codex and OpenCode snippets are) was switched to another model
without a word, perhaps one that takes no chats.  Now a load while other models serve is
a question with two answers, and `default` moves only when the owner says so:

- **Replace** the default model: it is unloaded once its running requests finish, and
  `default` names the new model from the next request on;
- **Add beside**: the default model keeps serving and stays `default`; the new one is
  served by its own name, and becomes `default` only if the owner ticks that.

Unloading the default model while others serve asks the same: which model `default`
names from now on, or none (its requests are refused until a load).

`served_models` reads who used each model lately from the request inspector's records;
`load_question` and `unload_question` say it in words, and `quit_question` what quitting
the app (which stops every model and the port) means for them.  Pure: the window shows the words
and the choice goes back as a `LoadChoice`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from backend.app.pool.pool_status import ModelStatus, Residency
from backend.admission.caller import ANONYMOUS
from backend.keys.key_store import CHAT_NAME, OWNER_NAME
from backend.models.model_names import DEFAULT_MODEL_ALIAS
from backend.port.request_log import RequestRecord

__all__ = ["RECENT_MINUTES", "LoadChoice", "LoadQuestion", "ServedModel", "UnloadQuestion",
           "load_question", "quit_question", "served_models", "unload_question"]

#: How far back "used lately" looks.
RECENT_MINUTES = 10


class LoadChoice(enum.Enum):
    REPLACE = "replace"  #: the new model replaces the default one, and is `default`
    BESIDE = "beside"  #: served beside the others; `default` stays
    BESIDE_AS_DEFAULT = "beside-as-default"  #: beside the others, and `default` from now on


@dataclass(frozen=True)
class ServedModel:
    """A model of the pool as a swap concerns it."""

    name: str
    default: bool
    #: In memory or on its way there (a model that is not loads on its next request).
    loaded: bool
    #: The keys that sent it requests in the last RECENT_MINUTES (the Chat tab's aside).
    users: tuple[str, ...] = ()
    #: Requests it runs or has waiting now.
    busy: int = 0


@dataclass(frozen=True)
class LoadQuestion:
    """Load `new` while `current` is the default model: the words of each answer."""

    new: str
    current: str
    title: str
    #: What serves now, and who used it lately.
    now: str
    #: What Replace does, as teammates see it.
    replace: str
    #: What Add beside does.
    beside: str
    #: The words of "and make it the default" beside Add beside.
    make_default: str


@dataclass(frozen=True)
class UnloadQuestion:
    """Unload `name`, the default model, while `others` serve."""

    name: str
    others: tuple[str, ...]
    title: str
    text: str


def served_models(statuses: Iterable[ModelStatus], records: Iterable[RequestRecord], *,
                  now: float, busy: dict[str, int] | None = None,
                  minutes: int = RECENT_MINUTES) -> list[ServedModel]:
    """The chat models of the pool (`statuses`), each with the keys the inspector's
    `records` saw using it in the last `minutes` before `now` (epoch seconds) and its
    requests running or waiting (`busy`, by model)."""
    since = now - minutes * 60
    users: dict[str, list[str]] = {}
    for record in records:
        if record.time >= since and record.model and record.key != CHAT_NAME:
            named = users.setdefault(record.model, [])
            if record.key not in named:
                named.append(record.key)
    loaded = (Residency.LOADING, Residency.READY)
    return [ServedModel(status.name, status.default, status.residency in loaded,
                        tuple(users.get(status.name, ())), (busy or {}).get(status.name, 0))
            for status in statuses if not status.embeddings]


def load_question(new: str, served: Sequence[ServedModel], *,
                  takes_chats: bool = True) -> LoadQuestion | None:
    """What to ask before loading `new` (a model of that name, `takes_chats` or not);
    None when nothing else is served, so that the load changes nobody's model."""
    current = next((m for m in served if m.default), None)
    if current is None or current.name == new:
        return None
    alias = f"`{DEFAULT_MODEL_ALIAS}`"
    others = [m for m in served if m.name not in (current.name, new) and m.loaded]
    now = f"{current.name} is the default model ({_state(current)}){_used_by(current)}."
    if others:
        now += " Also served: " + ", ".join(m.name for m in others) + "."
    switched = f"agents set up with {alias} (as the Codex and OpenCode snippets are) get {new} " \
               "from their next request"
    if not takes_chats:
        switched += ", which has no chat template: their chats are refused"
    replace = (f"Replace: {current.name} is unloaded once its running requests finish (up to "
               f"the reload grace); {switched}. Requests that name {current.name} are refused.")
    beside = (f"Add beside: {current.name} keeps serving and stays {alias}; {new} is served "
              f"beside it by its name ({new}). Memory permitting: the least recently used "
              "model nobody is using may be unloaded to make room.")
    make_default = f"…and make {new} the default: {switched}."
    return LoadQuestion(new, current.name, f"Load {new} while {current.name} serves?", now,
                        replace, beside, make_default)


def unload_question(name: str, served: Sequence[ServedModel]) -> UnloadQuestion | None:
    """What to ask before unloading `name`; None unless it is the default model and other
    chat models are served (then `default` would name none of them until the owner says
    which)."""
    model = next((m for m in served if m.name == name), None)
    others = tuple(m.name for m in served if m.name != name)
    if model is None or not model.default or not others:
        return None
    alias = f"`{DEFAULT_MODEL_ALIAS}`"
    text = (f"{name} is the default model{_used_by(model)}. Agents set up with {alias} get "
            "the model you choose here from their next request; with none, their requests are "
            "refused until you load one.")
    return UnloadQuestion(name, others, f"Unload {name}, the default model?", text)


def quit_question(records: Iterable[RequestRecord], *, now: float, busy: int,
                  shared: bool = True, minutes: int = RECENT_MINUTES) -> str | None:
    """What quitting stops for the port's users: `busy` requests running or waiting, and
    the keys that used the port in the last `minutes` before `now` (their agents get no
    answer once it stops); on a port not `shared` on the network, the owner's key and
    requests without a key came from this computer: named keys only.  None when there is
    neither: quitting needs no question."""
    since = now - minutes * 60
    mine = {CHAT_NAME} if shared else {CHAT_NAME, OWNER_NAME, ANONYMOUS.name}
    users: list[str] = []
    for record in records:
        if record.time >= since and record.key not in mine and record.key not in users:
            users.append(record.key)
    if not busy and not users:
        return None
    said = []
    if busy:
        said.append(f"{busy} request{'s are' if busy != 1 else ' is'} running or waiting; "
                    "quitting ends them.")
    if users:
        said.append(f"{_names(users)} used the port in the last {minutes} minutes: their "
                    "agents get no answer until GGUF Studio runs again and a model is loaded.")
    return " ".join(said)


# --- helpers ------------------------------------------------------------------------------

def _state(model: ServedModel) -> str:
    if model.busy:
        return f"{model.busy} request{'s' if model.busy != 1 else ''} running or waiting now"
    return "idle now" if model.loaded else "not loaded now"


def _used_by(model: ServedModel) -> str:
    if not model.users:
        return f"; nobody used it in the last {RECENT_MINUTES} minutes"
    return f"; used in the last {RECENT_MINUTES} minutes by " + _names(model.users)


def _names(names: Sequence[str]) -> str:
    named = list(names[:4]) + ([f"{len(names) - 4} more"] if len(names) > 4 else [])
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
