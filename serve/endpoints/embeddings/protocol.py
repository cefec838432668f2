"""The embeddings wire format (POST /v1/embeddings), as OpenAI's: `input` as a string, a list of
strings, a list of token ids or a list of such lists; `encoding_format` float or base64 (the
little-endian float32 bytes, which the official client asks for by default and decodes);
`dimensions` only as the model's own, since a causal LM's pooled state is not trained to be cut
short (Matryoshka-style) and a shortened vector would be another, untested, embedding.

Bounded as the Responses API's input is: at most --max-input-items inputs, their texts at most
--max-input-bytes together, each list of ids within the model's context (`bounds`); an empty
string is refused, as OpenAI refuses it.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from doel.serve.edge.bounds import few_items, limits
from doel.serve.endpoints.protocol import Request, prompts_within_context, unicode_text


def bounded(value):
    """At most --max-input-items inputs and --max-input-bytes of text, counted before any item
    is validated; no empty text."""
    items = value if isinstance(value, list) and value and not isinstance(value[0], int) else None
    few_items(items)
    texts = [value] if isinstance(value, str) else [v for v in items or () if isinstance(v, str)]
    size, limit = 0, limits().max_input_bytes
    for i, text in enumerate(texts):
        if not text:
            raise PydanticCustomError(
                "empty_input", "input {i} is an empty string; send text to embed", {"i": i}
            )
        size += len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PydanticCustomError(
                "input_size",
                "the input's texts are over {limit:,} bytes, this server's limit "
                "(--max-input-bytes); send fewer or shorter texts",
                {"limit": limit},
            )
    return value


class EmbeddingsRequest(Request):
    """POST /v1/embeddings."""

    model: str | None = None
    input: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1)]
    ) = Field(description="a text, texts, token ids (no BOS added), or lists of token ids")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="only the model's own")
    user: str | None = None

    _bounded = field_validator("input", mode="before")(bounded)
    _within_context = field_validator("input", mode="before")(prompts_within_context)
    _unicode = field_validator("input")(unicode_text)

    def inputs(self) -> list[str | list[int]]:
        """One item per embedding: a text or a list of ids."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]  # type: ignore[list-item]
        return list(self.input)  # type: ignore[arg-type]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()
