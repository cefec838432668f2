"""Text in, tokens out: documents from files (textio), the Bangla-fair tokenizer and its
fertility report, `prepare` (with its input stream, resume record and overlap check) writing
token shards, and the loader that reads them back for training."""
