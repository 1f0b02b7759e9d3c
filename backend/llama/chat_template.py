"""The chat template a model's chats are rendered with: its own, one its owner picks, or none.

A GGUF file may carry a chat template (`tokenizer.chat_template`); many base models do
not (Gemma 3 270M, the tests' real sliding-window model, has none).  llama-server then
renders chats with its fallback (ChatML) all the same, and the model answers junk with
nothing to say why.  So a model without one takes no chats here: the port answers its
chat routes with 400 `model_has_no_chat_template` (`backend.errors.NoChatTemplate`) and
`/v1/completions` takes plain prompts, until the owner picks a template for it.  The
pick (`LoadSettings.chat_template`, a models file's `chat_template`, `serve
--chat-template`, the Model tab) is one text:

- "" (the default): the model's own template;
- a name of llama.cpp's built-in templates (`BUILT_IN_TEMPLATES`: chatml, gemma, llama3,
  ...);
- the path of a Jinja template file;
- "none": no chat template, even where the file has one (plain completion only).

`chat_template_args` is how the engine is started for a pick, and `ChatTemplate` says
what a model's chats are rendered with (the load report, the window, `/health`).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

from backend.errors import SettingsError

__all__ = ["BUILT_IN_TEMPLATES", "NO_TEMPLATE", "OWN_TEMPLATE", "ChatTemplate", "TemplateSource",
           "chat_template_args", "check_chat_template", "normal_chat_template",
           "resolved_chat_template"]

#: The pick that means the model's own template.
OWN_TEMPLATE = ""
#: The pick that means no chat template at all: plain completion only.
NO_TEMPLATE = "none"
#: llama.cpp's built-in templates, as the pinned sources name them (src/llama-chat.cpp's
#: LLM_CHAT_TEMPLATES, in its order; a test checks them against the sources).
BUILT_IN_TEMPLATES = (
    "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1",
    "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4",
    "falcon3", "zephyr", "monarch", "gemma", "orion", "openchat", "vicuna", "vicuna-orca",
    "deepseek", "deepseek2", "deepseek3", "deepseek-ocr", "command-r", "llama3", "chatglm3",
    "chatglm4", "glmedge", "minicpm", "exaone3", "exaone4", "exaone-moe", "rwkv-world",
    "granite", "granite-4.0", "granite-4.1", "gigachat", "megrez", "yandex", "bailing",
    "bailing-think", "bailing2", "llama4", "smolvlm", "hunyuan-moe", "gpt-oss",
    "hunyuan-dense", "hunyuan-vl", "kimi-k2", "seed_oss", "grok-2", "pangu-embedded",
    "solar-open",
)
#: The longest template name kept of what another port says.
_MAX_NAME = 120
#: The one built-in template llama.cpp also renders with its Jinja engine (its own Jinja
#: ChatML source), so that requests with tools work; the others only by its older
#: renderer, which takes no tools (`--no-jinja`).
_JINJA_BUILT_IN = "chatml"


class TemplateSource(enum.Enum):
    OWN = "own"  #: the model's own, from its GGUF file
    BUILT_IN = "built-in"  #: one of llama.cpp's, picked by the owner
    FILE = "file"  #: a Jinja file the owner picked
    NONE = "none"  #: none: chat routes are refused, plain completion works


@dataclass(frozen=True)
class ChatTemplate:
    """What a model's chats are rendered with, for people and `/health`: no paths (a
    file is named by its file name)."""

    source: TemplateSource
    #: The built-in template's name, or the file's name; "" otherwise.
    name: str = ""
    #: Whether the model's GGUF file carries a template of its own.
    model_has_one: bool = True

    @classmethod
    def of(cls, pick: str, *, model_has_one: bool) -> "ChatTemplate":
        """The template of a model whose file has one or not (`model_has_one`) and
        whose owner picked `pick` (see the module docstring)."""
        pick = normal_chat_template(pick)
        if pick == NO_TEMPLATE or (pick == OWN_TEMPLATE and not model_has_one):
            return cls(TemplateSource.NONE, model_has_one=model_has_one)
        if pick == OWN_TEMPLATE:
            return cls(TemplateSource.OWN, model_has_one=model_has_one)
        if pick in BUILT_IN_TEMPLATES:
            return cls(TemplateSource.BUILT_IN, pick, model_has_one)
        return cls(TemplateSource.FILE, os.path.basename(pick), model_has_one)

    @property
    def takes_chats(self) -> bool:
        """Whether chat routes may reach the model."""
        return self.source is not TemplateSource.NONE

    def describe(self) -> str:
        """"the model's own", "gemma (llama.cpp's built-in, picked by the owner)", ..."""
        if self.source is TemplateSource.OWN:
            return "the model's own"
        if self.source is TemplateSource.BUILT_IN:
            return f"{self.name} (llama.cpp's built-in, picked by the owner)"
        if self.source is TemplateSource.FILE:
            return f"{self.name} (a template file the owner picked)"
        if self.model_has_one:
            return "none (turned off by the owner)"
        return "none (the model has no chat template)"

    def warning(self) -> str:
        """What a model without a chat template means for its clients; "" for one with."""
        if self.takes_chats:
            return ""
        why = ("Its chat template is turned off" if self.model_has_one
               else "This model has no chat template")
        return (f"{why}: chat requests (/v1/chat/completions, /v1/responses, /v1/messages) "
                "are refused with 400 model_has_no_chat_template, and /v1/completions takes "
                "plain prompts. Pick a template for it: serve --chat-template NAME|FILE, "
                "chat_template in the models file, or Chat template in the Model tab.")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source.value, "name": self.name or None,
                "model_has_one": self.model_has_one, "takes_chats": self.takes_chats}

    @classmethod
    def from_dict(cls, data: Any) -> "ChatTemplate | None":
        """What another GGUF Studio port's `/health` says of a model's template
        (`to_dict`); None when it says nothing usable."""
        if not isinstance(data, dict):
            return None
        try:
            source = TemplateSource(data.get("source"))
        except ValueError:
            return None
        name = data.get("name")
        name = name[:_MAX_NAME] if isinstance(name, str) and name.isprintable() else ""
        return cls(source, name, data.get("model_has_one") is not False)


def normal_chat_template(pick: str) -> str:
    """`pick` as kept: trimmed; a built-in name or "none" in lower case."""
    text = str(pick or "").strip()
    lowered = text.lower()
    return lowered if lowered in BUILT_IN_TEMPLATES or lowered == NO_TEMPLATE else text


def resolved_chat_template(pick: str, folder: str | os.PathLike[str]) -> str:
    """`pick` with a file's path taken from `folder` (a models file's, the command line's
    working directory) and made absolute; a name, "" and "none" as they are."""
    pick = normal_chat_template(pick)
    if pick in (OWN_TEMPLATE, NO_TEMPLATE) or pick in BUILT_IN_TEMPLATES:
        return pick
    return os.path.normpath(os.path.join(folder, os.path.expanduser(pick)))


def check_chat_template(pick: str, *, as_given: str | None = None) -> None:
    """SettingsError unless `pick` is "", "none", a built-in name or a readable file;
    the message names it `as_given` (a file's path before it was resolved), else as it is."""
    pick = normal_chat_template(pick)
    if pick in (OWN_TEMPLATE, NO_TEMPLATE) or pick in BUILT_IN_TEMPLATES:
        return
    path = os.path.expanduser(pick)
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise SettingsError(
            f"The chat template {as_given or pick!r} is neither one of llama.cpp's built-in templates "
            "(chatml, gemma, llama3, mistral-v7, phi4, ... the Model tab lists them all) nor "
            "a readable Jinja template file.")


def chat_template_args(pick: str, *, model_has_one: bool) -> list[str]:
    """llama-server's flags for `pick` on a model whose file has a template or not."""
    pick = normal_chat_template(pick)
    if pick == _JINJA_BUILT_IN:
        return ["--jinja", "--chat-template", pick]
    if pick in BUILT_IN_TEMPLATES:
        # Read as Jinja source, a name would be rendered as the text it is.
        return ["--no-jinja", "--chat-template", pick]
    if pick not in (OWN_TEMPLATE, NO_TEMPLATE):
        return ["--jinja", "--chat-template-file", os.path.abspath(os.path.expanduser(pick))]
    return ["--jinja"] if model_has_one else []
