"""POST /v1/embeddings, OpenAI's shape, for a bundle exported with --embeddings."""
