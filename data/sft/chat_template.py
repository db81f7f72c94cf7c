"""A conversation as token ids and the assistant tokens the loss is on, by the tokenizer's
own chat template (transformers' `apply_chat_template`).

Which tokens are the assistant's:
- a template with `{% generation %}` blocks says so itself: transformers' assistant mask
  (`apply_chat_template(..., return_assistant_tokens_mask=True)`), used as is;
- a template without them: the loss is on each assistant turn as the template renders it
  after the generation prompt, i.e. the text `render(turns[:k+1])` adds to
  `render(turns[:k], add_generation_prompt=True)` for assistant turn k (its content and
  whatever the template closes the turn with, e.g. an end-of-turn token); a token counts when
  its first character lies in that text. A template that does not render a conversation's
  prefixes as prefixes of the whole cannot be read this way: one line says so (add
  `{% generation %}` blocks). The rule is printed once (`FALLBACK_RULE`).
"""
from __future__ import annotations

import os
import re
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from gigatron.data.sft.conversations import Message

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
FALLBACK_RULE = ("the chat template has no {% generation %} blocks: the loss is on each "
                 "assistant turn as the template renders it after the generation prompt "
                 "(its content and the template's end of the turn)")


def tokenizer_folder(tokenizer_model: Optional[str]) -> str:
    """The Hugging Face tokenizer folder --tokenizer-model names (a folder, or the folder of
    a tokenizer.json)."""
    if not tokenizer_model:
        raise ValueError("--sft needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
                         "DIR (a Hugging Face tokenizer folder with a chat template)")
    path = str(tokenizer_model)
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


class ChatTemplateTokenizer:
    """Conversations -> (ids, assistant mask) with a local Hugging Face tokenizer's chat
    template (nothing is downloaded, no code from the folder runs)."""

    def __init__(self, tokenizer_model: Optional[str]) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # optional: only --sft's chat templates need it
            raise ImportError("--sft tokenizes with the tokenizer's chat template through "
                              "transformers: pip install transformers") from err

        folder = tokenizer_folder(tokenizer_model)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"--tokenizer-model {tokenizer_model}: the tokenizer has no chat "
                             f"template (--sft tokenizes conversations with it): add "
                             f"chat_template.jinja, or 'chat_template' in "
                             f"tokenizer_config.json, to {folder}")
        self.template = template if isinstance(template, str) else str(template)
        self.has_generation_blocks = bool(_GENERATION.search(self.template))
        self.pad = self.tokenizer.pad_token_id

    def render(self, turns: Sequence[Message], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(list(turns), tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def tokenize(self, conversation: Sequence[Message]) -> Tuple[np.ndarray, np.ndarray]:
        """(ids int64 [n], assistant bool [n]) of one conversation."""
        if self.has_generation_blocks:
            out = self.tokenizer.apply_chat_template(
                list(conversation), tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)
            return (np.asarray(out["input_ids"], dtype=np.int64),
                    np.asarray(out["assistant_masks"], dtype=bool))
        return self._by_rendered_turns(conversation)

    def _by_rendered_turns(self, conversation: Sequence[Message]
                           ) -> Tuple[np.ndarray, np.ndarray]:
        text = self.render(conversation)
        spans: List[Tuple[int, int]] = []
        for k, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            before = self.render(conversation[:k], generation_prompt=True) if k else ""
            upto = self.render(conversation[:k + 1])
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ValueError("the chat template does not render a conversation's first "
                                 "turns as the start of the whole, so the assistant tokens "
                                 "cannot be told without {% generation %} blocks: add them "
                                 "to the template")
            spans.append((len(before), len(upto)))
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        assistant = np.zeros(len(starts), dtype=bool)
        for lo, hi in spans:
            assistant |= (starts >= lo) & (starts < hi)
        return np.asarray(enc["input_ids"], dtype=np.int64), assistant
