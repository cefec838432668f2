"""The stages of a recipe in order, and what each one's fingerprint chains to: the shape of a
recipe, shared by the runner, its summary and the command line (standard library only, so
`doel-train --help` stays quick)."""

STAGES = ("data", "tokenizer", "shards", "verify", "train", "eval", "sft", "export", "summary")
DEPENDS = {  # stage -> (the stage before it in the chain, the plan parts it reads)
    "data": (None, ("sources", "data", "token_budget")),
    "tokenizer": ("data", ("tokenizer",)),
    "shards": ("tokenizer", ("prepare",)),
    "verify": ("shards", ("train", "gpus", "verify")),
    "train": ("shards", ("train", "gpus")),
    "eval": ("train", ("eval",)),
    "sft": ("train", ("sft",)),  # off unless [sft] enabled: then export bundles the chat model
    "export": ("sft", ("export",)),
}
