"""Embeddings of a causal LM (doel-export --embeddings, served by /v1/embeddings): Bangla retrieval
accuracy beside a bag-of-words baseline, and throughput, on this CPU.

The task: the TyDi QA GoldP Bengali dev set (../shared/data/eval/bn_tydiqa_goldp, 113 questions,
each written for one of 105 Wikipedia passages): every question ranks all the passages by cosine
similarity, and the rank of its own passage is scored as top-1 and top-5 accuracy and mean
reciprocal rank. Held-out for every model here: SmolLM2 never trained on it.
- the model: SmolLM2-135M-Instruct, imported (bench_real_model.imported), its embeddings graph
  written by export/embedder.py with each pooling (mean over tokens, last token), run by the
  server's own `Encoder` (serve/endpoints/embeddings/route.py); a passage is read up to
  MAX_TOKENS tokens (its start), which two cores can afford for the whole set;
- the baseline: bag of words, TF-IDF weighted (idf over the passages), cosine; words split on
  whitespace and punctuation, Bangla's dari included; on the whole passages, and on the same
  window the model reads;
- chance: the mean reciprocal rank of a random order.

Throughput: the passages and questions through the Encoder as a request's inputs are (sorted by
length, batched up to its padded-position budget), and PEER texts one a run through the Encoder
and through the same pooled model in PyTorch fp32 (the peer: the ratio is the claim, not the
tokens/s).

Writes benchmarks/results/embeddings_smollm2-135m_cpu-<class>.{json,md}. Run under the machine
lock: `flock /tmp/doel-bench.lock python -m benchmarks.serve.bench_embeddings` (minutes).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.common.cpu_class import this_cpu
from benchmarks.common.report import ROOT, cpu_name, load_line, machine, parser, publish

RESULTS = ("embeddings_smollm2-135m_cpu-<class>",)
TYDI = ROOT.parent / "shared" / "data" / "eval" / "bn_tydiqa_goldp" / "bengali_tydiqa_dev.json"
# A passage's tokens read: SmolLM2's tokenizer spends about 1.8 tokens on a Bangla character,
# so this is its first ~140 characters (the baseline is scored on the same window too); the
# whole set at this length takes minutes a pooling on 2 cores
MAX_TOKENS = 256
PEER = 8  # passages timed one a run, in ONNX Runtime and in PyTorch
POOLINGS = ("mean", "last")
WORDS = re.compile(r"[^\s।,.;:!?()\[\]\"'‘’“”\-—]+")


def qa_set(path: Path = TYDI) -> tuple[list[str], list[int], list[str]]:
    """(questions, the index of each one's passage, the distinct passages)."""
    data = json.loads(path.read_text(encoding="utf-8"))["data"]
    passages, where, questions, gold = [], {}, [], []
    for article in data:
        for p in article["paragraphs"]:
            if p["context"] not in where:
                where[p["context"]] = len(passages)
                passages.append(p["context"])
            for q in p["qas"]:
                questions.append(q["question"])
                gold.append(where[p["context"]])
    return questions, gold, passages


def bow_scores(questions: list[str], passages: list[str]) -> np.ndarray:
    """TF-IDF bag-of-words cosine, [questions, passages]."""
    docs = [Counter(WORDS.findall(p.lower())) for p in passages]
    df = Counter(w for d in docs for w in d)
    idf = {w: math.log((1 + len(docs)) / (1 + n)) + 1 for w, n in df.items()}

    def vec(counts: Counter) -> dict:
        v = {w: c * idf.get(w, 0.0) for w, c in counts.items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {w: x / norm for w, x in v.items()}

    ps = [vec(d) for d in docs]
    qs = [vec(Counter(WORDS.findall(q.lower()))) for q in questions]
    return np.array([[sum(x * p.get(w, 0.0) for w, x in q.items()) for p in ps] for q in qs])


def scored(scores: np.ndarray, gold: list[int]) -> dict:
    """Top-1, top-5 and MRR of the gold passage's rank (ties count against it)."""
    own = scores[np.arange(len(gold)), gold]
    ranks = 1 + (scores > own[:, None]).sum(1) + (scores == own[:, None]).sum(1) - 1
    return {
        "top1": float((ranks == 1).mean()),
        "top5": float((ranks <= 5).mean()),
        "mrr": float((1.0 / ranks).mean()),
    }


def chance(n: int) -> dict:
    return {"top1": 1 / n, "top5": min(5, n) / n, "mrr": sum(1 / r for r in range(1, n + 1)) / n}


def graph(ckpt: Path, work: Path, pooling: str) -> dict:
    """The embeddings graph of one pooling, written into `work` (export/embedder.py), and its
    record."""
    from doel.export.embedder import write_graph

    return write_graph(ckpt, work / f"embeddings-{pooling}.onnx", pooling, ckpt / "tokenizer.json")


def timed(fn, *args) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run_pooling(ckpt: Path, work: Path, pooling: str, rows: dict, gold: list[int]) -> dict:
    from doel.serve.endpoints.embeddings.route import Encoder

    record = graph(ckpt, work, pooling)
    enc = Encoder(work, record, os.cpu_count() or 1)
    enc.encode(rows["questions"][:4])  # warm
    p, p_s = timed(enc.encode, rows["passages"])
    q, q_s = timed(enc.encode, rows["questions"])
    tokens = sum(map(len, rows["passages"])) + sum(map(len, rows["questions"]))
    texts = len(rows["passages"]) + len(rows["questions"])
    out = {
        "pooling": pooling,
        "dimensions": record["dimensions"],
        "max_abs_diff": record["max_abs_diff"],
    }
    out |= scored(q @ p.T, gold)
    out |= {"texts_per_s": texts / (p_s + q_s), "tokens_per_s": tokens / (p_s + q_s)}
    peer = rows["passages"][:PEER]
    _, one_s = timed(lambda: [enc.encode([r]) for r in peer])
    torch_s = torch_peer(ckpt, pooling, peer)
    n = sum(map(len, peer))
    out |= {"one_a_run_tokens_per_s": n / one_s, "torch_tokens_per_s": n / torch_s}
    return out


def torch_peer(ckpt: Path, pooling: str, rows: list[list[int]]) -> float:
    """Seconds PyTorch fp32 takes for the same pooled model, one text a run."""
    import torch

    from doel.export.embedder import _module

    torch.set_num_threads(os.cpu_count() or 1)
    module = _module(ckpt, pooling)[0]
    with torch.no_grad():
        module(torch.tensor([rows[0][:8]]), torch.ones(1, 8, dtype=torch.int64))  # warm
        t0 = time.perf_counter()
        for r in rows:
            module(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.int64))
        return time.perf_counter() - t0


def _row(*cells) -> str:
    return "| " + " | ".join(cells) + " |"


def report(result: dict) -> str:
    rows = [_row("method", "top-1", "top-5", "MRR", "texts/s", "tokens/s")]
    rows.append("|---|---:|---:|---:|---:|---:|")
    for m in result["methods"]:
        texts = f"{m['texts_per_s']:,.1f}" if "texts_per_s" in m else ""
        tokens = f"{m['tokens_per_s']:,.0f}" if "tokens_per_s" in m else ""
        scores = (f"{m[k]:.3f}" for k in ("top1", "top5", "mrr"))
        rows.append(_row(m["name"], *scores, texts, tokens))
    peer = [
        _row(
            "pooling",
            "ONNX Runtime, batched",
            "ONNX Runtime, one a run",
            "PyTorch fp32, one a run",
            "ONNX Runtime / PyTorch",
        ),
        "|---|---:|---:|---:|---:|",
    ]
    for m in result["methods"]:
        if "torch_tokens_per_s" in m:
            ratio = m["one_a_run_tokens_per_s"] / m["torch_tokens_per_s"]
            speeds = (
                m[k] for k in ("tokens_per_s", "one_a_run_tokens_per_s", "torch_tokens_per_s")
            )
            peer.append(_row(m["pooling"], *(f"{x:,.0f}" for x in speeds), f"{ratio:.2f}x"))
    n, texts = result["passages"], result["passages"] + result["questions"]
    title = "Embeddings: Bangla question-passage retrieval and throughput"
    return "\n".join(
        [
            f"# {title} ({result['date']}, {result['machine']})",
            "",
            f"CPU: {cpu_name(result['cpu'])}; {result['threads']} threads; load average "
            f"{result['load_start']:.1f} at the start, {result['load_end']}.",
            "",
            f"Task: TyDi QA GoldP Bengali dev, {result['questions']} questions each ranking "
            f"{n} passages by cosine similarity (its own passage's rank). Model: "
            f"{result['model']}, its last hidden state pooled and normalized "
            f"(doel-export --embeddings), a passage read up to {MAX_TOKENS} tokens "
            f"({result['cut']} of {n} were longer). Made by "
            "benchmarks/serve/bench_embeddings.py.",
            "",
            *rows,
            "",
            f"Throughput (tokens/s; batched: all {texts} texts as one request's inputs; one a run: "
            f"{PEER} passages, {result['peer_tokens']:,} tokens):",
            "",
            *peer,
            "",
        ]
    )


def main() -> None:
    ap = parser(__doc__, work="scratch folder: the imported model and its graphs (kept)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from benchmarks.export.bench_real_model import imported

    work = Path(args.work or ROOT / "out" / "bench-embeddings")
    work.mkdir(parents=True, exist_ok=True)
    start = {"date": date.today().isoformat(), "machine": machine(), "cpu": this_cpu()}
    start["load_start"] = os.getloadavg()[0]
    ckpt = imported(work)
    questions, gold, passages = qa_set()
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    full = [e.ids for e in tok.encode_batch(passages)]
    rows = {
        "passages": [r[:MAX_TOKENS] for r in full],
        "questions": [e.ids[:MAX_TOKENS] for e in tok.encode_batch(questions)],
    }
    t0 = time.perf_counter()
    bow = scored(bow_scores(questions, passages), gold)
    bow_s = time.perf_counter() - t0
    window = [tok.decode(r) for r in rows["passages"]]  # what the model reads of each
    methods = [
        {"name": "chance"} | chance(len(passages)),
        {"name": "bag of words (TF-IDF), whole passages"}
        | bow
        | {"texts_per_s": (len(questions) + len(passages)) / bow_s},
        {"name": f"bag of words (TF-IDF), the model's {MAX_TOKENS}-token window"}
        | scored(bow_scores(questions, window), gold),
    ]
    for pooling in POOLINGS:
        m = run_pooling(ckpt, work, pooling, rows, gold)
        methods.append({"name": f"SmolLM2-135M, {pooling} pooling"} | m)
    result = start | {
        "model": "SmolLM2-135M-Instruct (imported, fp32)",
        "threads": os.cpu_count(),
        "questions": len(questions),
        "passages": len(passages),
        "cut": sum(len(r) > MAX_TOKENS for r in full),
        "max_tokens": MAX_TOKENS,
        "peer_tokens": sum(map(len, rows["passages"][:PEER])),
        "methods": methods,
        "load_end": load_line(),
    }
    cls = result["cpu"]["class"]
    publish(args.out, f"embeddings_smollm2-135m_cpu-{cls}", result, report(result))


if __name__ == "__main__":
    main()
