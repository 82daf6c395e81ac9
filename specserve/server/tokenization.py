"""vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`.

lm-eval's `local-completions` model asks for them before anything else; when they answer, it tokenizes
through the server and needs no tokenizer of its own (no `transformers`, no hub id or local path). A
prompt tokenizes exactly as /v1/completions tokenizes it and messages as /v1/chat/completions renders
and tokenizes them, so counts and truncation done with these ids hold for those routes.
"""

from __future__ import annotations

from specserve.server.async_engine import the_requests_fault
from specserve.server.generation import ChatGeneration
from specserve.server.protocol import DetokenizeRequest, RequestFieldError, TokenizeRequest, TokenizerInfo


def token_ids(tokenizer, body: TokenizeRequest, chat: ChatGeneration | None) -> list[int]:
    """The ids of `body`'s prompt, or of its messages rendered by `chat` (on a tokenizer thread)."""
    if chat is None:
        add_special_tokens = body.add_special_tokens is not False
        return tokenizer(body.prompt, add_special_tokens=add_special_tokens).input_ids
    with the_requests_fault("the messages could not be rendered", "messages"):
        text = chat.rendered(body.add_generation_prompt).text
    return tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids


def check_token_ids(body: DetokenizeRequest, vocab_size: int) -> None:
    outside = [t for t in body.tokens if t >= vocab_size]
    if outside:
        raise RequestFieldError("tokens", f"token ids must be in [0, {vocab_size}), got {outside[:5]}")


def tokenizer_info(tokenizer) -> TokenizerInfo:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: chat renders with the default one
        template = template.get("default")
    return TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        chat_template=template,
    )
