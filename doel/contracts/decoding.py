"""How a completion's ids become text, in every runtime doel ships (doel-serve, the browser
page): a few prompt ids are decoded in front of the completion and their text cut off, so a
decoder that treats the first token specially (SentencePiece's leading space, stripped by the
default tokenizer's decoder) decodes the completion as it would inside the whole text."""

CONTEXT_IDS = 4  # prompt ids decoded in front of a completion
