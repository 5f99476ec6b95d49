"""``python -m moco_retrieval.search``: semantic search over a corpus with a trained or exported model.

    python -m moco_retrieval.search checkpoint=CKPT query="resize images from the command line"
    python -m moco_retrieval.search model_dir=EXPORTED k=5 < queries.txt      # one query a line
    python -m moco_retrieval.search model_dir=EXPORTED corpus=BEIR_DIR_OR_corpus.jsonl format=json
    python -m moco_retrieval.search model_dir=EXPORTED corpus=eval query="..."   # the held-out pool only

The first call encodes the corpus, builds the FAISS index (``eval.index``: flat, ivf or hnsw) and
saves it in ``index_dir`` (default ``$MOCO_RETRIEVAL_CACHE/search/<key>``, the key hashing the
model, the corpus and the index settings); later calls with the same model and corpus load it.
``rebuild=true`` forces a new one (search_index.py). Queries come from ``query=...`` / ``queries=[...]``, else from
standard input (one a line; an interactive prompt on a terminal).

Before encoding a corpus it says how many documents and about how long (timed on a sample).
Default corpus: the data group's documents. Debian (default): every package description, training
and held-out ones, the package name as id: a semantic ``apt search``. ``data=beir``: ``data.dir``'s
corpus.jsonl; ``data=jsonl``: the training positives and ``data.eval_dir``'s corpus.

Keys: SearchConfig in config.py (``conf/search.yaml``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import DictConfig

from moco_retrieval.command import command
from moco_retrieval.config import EvalConfig, SearchConfig, check_queries, register_configs, to_config
from moco_retrieval.model.loading import load_encoder
from moco_retrieval.search_index import build_or_load_index, default_index_dir, model_identity

register_configs()

EVAL_CORPUS = "eval"
FULL_CORPUS_HINT = "corpus=eval searches only the held-out pool (faster); the index is saved, later searches load it"


def load_corpus(corpus: Optional[str], data: Any) -> tuple[Any, str]:
    """``(corpus view, description)`` from ``corpus`` (a file or folder, or ``eval``: the data
    group's held-out pool) or, when None, every document of the data group. A corpus.jsonl (given,
    or ``data=beir``'s) is a memory-mapped store converted once per content (data/corpus_store.py);
    the others are in memory behind the same interface (``len``, ``doc_ids``, ``texts(rows)``, ``text(id)``)."""
    from moco_retrieval.data.corpus_store import as_corpus, corpus_store
    from moco_retrieval.data.formats import DataError
    from moco_retrieval.data.sources import corpus_root, load_document_corpus

    if corpus == EVAL_CORPUS:  # the held-out pool of the data group: a fraction of its documents
        from moco_retrieval.data.sources import load_eval_pool_mapped

        pool = load_eval_pool_mapped(data)
        d = pool.description
        return as_corpus(pool.eval_set.corpus), f"the held-out pool of data={d['kind']} ({d['dir']}, {d['documents']:,} documents)"
    if corpus:
        p = Path(corpus).expanduser()
        if p.is_dir():
            p = p / "corpus.jsonl"
        if not p.is_file():
            raise DataError(f"corpus={corpus}: expected a corpus.jsonl file or a BEIR folder holding one")
        return corpus_store(p, corpus_root(data)), str(p)
    return load_document_corpus(data)


def _query_stream(cfg: Any) -> Iterable[str]:
    given = ([cfg.query] if cfg.query else []) + list(cfg.queries)
    if given:
        yield from given
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("query> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def _snippet(text: str, n: int) -> str:
    t = " ".join(text.split())
    return t if len(t) <= n else t[: n - 1] + "…"


def run_search(cfg: Any, out=None) -> list[dict]:
    """Answer the configured queries; prints them and returns ``[{query, results}]``."""
    from moco_retrieval.devices import pick_device
    from moco_retrieval.evaluation.encode import encode_texts

    out = out or sys.stdout
    SearchConfig.check(cfg)  # (read as is, a DictConfig: the dataclass's checks by hand) k, format, ...
    check_queries(cfg)
    eval_cfg = to_config(EvalConfig, cfg.eval)
    corpus, corpus_desc = load_corpus(cfg.corpus, cfg.data)
    enc, desc = load_encoder(checkpoint=cfg.checkpoint, model_dir=cfg.model_dir, model=cfg.model, encoder=cfg.encoder,
                             prompts=cfg.data.prompts)
    identity = model_identity(cfg)
    if not enc.prompts.empty:  # the documents are encoded with them: another index
        identity["prompts"] = enc.prompts.to_dict()
    index_dir = Path(cfg.index_dir).expanduser() if cfg.index_dir else default_index_dir(identity, corpus_desc, eval_cfg)
    enc.to(pick_device(cfg.device))
    batch_size = int(cfg.batch_size or cfg.data.eval_batch_size)
    index, built = build_or_load_index(enc, corpus, eval_cfg, index_dir, identity, batch_size=batch_size,
                                       rebuild=bool(cfg.rebuild), progress=bool(cfg.progress), what=corpus_desc,
                                       hint="" if cfg.corpus else FULL_CORPUS_HINT)
    print(f"{'built' if built else 'loaded'} index of {len(index.doc_ids):,} documents ({corpus_desc}) "
          f"in {index_dir}", file=sys.stderr)
    answers = []
    for q in _query_stream(cfg):
        emb = encode_texts(enc, [q], "query", show_progress=False)
        hits = index.search(emb, cfg.k)[0]
        answer = {"query": q, "results": [
            {"rank": r, "doc_id": d, "score": round(s, 4), "text": corpus.text(d)} for r, (d, s) in enumerate(hits, 1)
        ]}
        answers.append(answer)
        if cfg.format == "json":
            print(json.dumps(answer, ensure_ascii=False), file=out, flush=True)
        else:
            print(f"\n{q}", file=out)
            for h in answer["results"]:
                print(f"{h['rank']:>3}. {h['score']:+.3f}  {h['doc_id']}: {_snippet(h['text'], cfg.max_chars)}", file=out)
            out.flush()
    return answers


@command("search")
def main(cfg: DictConfig) -> None:
    run_search(cfg)


if __name__ == "__main__":
    main()
