"""Which requests kvtier can key by their token ids, and in which namespace.

kvtier names a page by the token ids up to it and the engine's namespace (model,
revision, KV dtype, block size, attention backend, parallel layout, rank). vLLM's own
prefix cache also keys a block by the request's LoRA adapter, its ``cache_salt``, its
multimodal inputs and its prompt embeddings: with any of them, the same token ids hold
other KV. So, per request:

* a **LoRA adapter** (its name and path, as vLLM keys it) or a **cache salt** puts the
  request's pages in a namespace of their own: the engine's, with the model id extended
  (``+lora=NAME@<hash of the path>``, ``+salt=<hash>``: the salt itself is never stored).
  Such requests share pages only with requests of the same adapter and salt;
* **prompt embeddings** (vLLM gives them placeholder token ids) and **multimodal inputs**
  are not keyed: kvtier neither loads nor saves such a request, and counts it in
  ``unkeyed_requests``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.keys import Namespace

#: The most bytes of a scope the lookup service takes (a long LoRA name is still far less).
MAX_SCOPE_BYTES = 4096


@dataclass(frozen=True)
class RequestScope:
    """``suffix``: what extends the model id of the request's namespace (``""``: the
    engine's namespace); ``skip``: why kvtier leaves the request alone, or ``None``."""

    suffix: str = ""
    skip: str | None = None


def _digest(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


def request_scope(request: Any) -> RequestScope:
    """The scope of a vLLM ``Request`` (see the module docstring)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return RequestScope(skip="prompt embeddings")
    if getattr(request, "mm_features", None):
        return RequestScope(skip="multimodal inputs")
    suffix = ""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = str(getattr(lora, "lora_name", "") or "")
        path = str(getattr(lora, "lora_path", "") or "")
        suffix += f"+lora={name}@{_digest(path)}"
    salt = getattr(request, "cache_salt", None)
    if salt:
        suffix += f"+salt={_digest(str(salt))}"
    return RequestScope(suffix)


def scoped(namespace: Namespace, suffix: str) -> Namespace:
    """``namespace`` with ``suffix`` appended to its model id (itself for ``""``)."""
    if not suffix:
        return namespace
    return dataclasses.replace(namespace, model_id=namespace.model_id + suffix)
