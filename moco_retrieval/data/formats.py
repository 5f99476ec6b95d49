"""Data formats users bring: JSONL training pairs and the BEIR layout.

Every reader validates its input completely before training starts and raises
:class:`DataError` (a ``ValueError``) with a message of the form
``<file>:<line>: <what was expected>`` (or ``<file>: ...`` when no line applies).

JSONL pairs (:func:`read_pairs_jsonl`), one JSON object a line (blank lines are skipped):

* ``query``, ``positive``: non-empty strings, required.
* ``query_id``: string (or integer, kept as its decimal string), optional.
* ``doc_id``: id of the positive, optional. A string is hashed with :func:`ids.stable_id`; a
  non-negative integer below 2**63 is used as is. :func:`write_pairs_jsonl` writes ids (and groups)
  as they were given (``"d9"`` stays ``"d9"``; a derived id as its integer), so a round trip keeps them. Without it the id is ``doc_id_for_text(positive)``: the same text always
  has the same id.
* ``group``: group of the positive (e.g. its source), optional: a string (hashed) or an integer
  (``-1`` = none). Documents of one group are each other's false negatives.
* ``negatives``: optional list of hard negatives, each a string (the text) or an object
  ``{"text", "doc_id"?, "score"?, "group"?}`` (ids as above).
* ``positive_score``: optional number: a teacher's score of (query, positive), what
  ``objective.distill`` trains on (objectives/distill.py).
* ``negative_scores``: optional list of numbers, the teacher's score of each negative, in order
  (one per negative: sentence-transformers' and Tevatron's layout); the same as each negative
  object's ``score``, which it may not repeat. Every score must be finite.

BEIR layout (:func:`read_beir`): ``corpus.jsonl`` (``_id``, ``text``, optional ``title``, optional
``group``, other keys ignored), ``queries.jsonl`` (``_id``, ``text``), ``qrels/<split>.tsv`` with the
header ``query-id<TAB>corpus-id<TAB>score``. A document's text is ``title + ". " + text`` when the
title is non-empty (``title + " " + text`` when the title already ends with ``. ! ? : ;``), else
``text``. Only queries with at least one judgment of score > 0 in the split are kept; every
qrels id must exist in the corpus / queries.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from moco_retrieval.errors import UserError

import orjson

from moco_retrieval.data.ids import NO_GROUP, doc_id_for_text, stable_id

PathLike = Union[str, os.PathLike]
_MAX_ID = (1 << 63) - 1
QRELS_HEADER = ("query-id", "corpus-id", "score")


class DataError(UserError, ValueError):
    """Bad input data; the message names the file, the line and what was expected."""


def _where(path: PathLike, line: Optional[int]) -> str:
    return f"{path}:{line}" if line is not None else f"{path}"


def _error(path: PathLike, line: Optional[int], msg: str) -> DataError:
    return DataError(f"{_where(path, line)}: {msg}")


@dataclass
class Negative:
    doc_id: int
    text: str
    score: Optional[float] = None
    group: int = NO_GROUP
    # the ids as the data gave them (a string or an integer; None: not given), which pair_to_json writes
    # back unchanged: a user's "d9" stays "d9" (doc_id and group are their hashes, see the module docstring)
    given_doc_id: Any = field(default=None, compare=False)
    given_group: Any = field(default=None, compare=False)


@dataclass
class Pair:
    query: str
    positive: str
    doc_id: int
    group: int = NO_GROUP
    query_id: Optional[str] = None
    negatives: list[Negative] = field(default_factory=list)
    positive_score: Optional[float] = None
    given_doc_id: Any = field(default=None, compare=False)  # as in Negative
    given_group: Any = field(default=None, compare=False)

    @property
    def scored(self) -> bool:
        """Whether a teacher scored the row: its positive and every hard negative (what distillation needs)."""
        return self.positive_score is not None and bool(self.negatives) and all(n.score is not None for n in self.negatives)


@dataclass
class EvalSet:
    corpus: dict[str, str]  # doc id -> document text
    queries: dict[str, str]  # query id -> query text
    qrels: dict[str, dict[str, int]]  # query id -> {doc id: relevance}
    doc_groups: Optional[dict[str, int]] = None  # doc id -> group id (-1 none), when known


# ----------------------------------------------------------------------------------------- JSONL


@dataclass(frozen=True)
class Span:
    """A part of a file: the lines starting at bytes ``start`` (a line's first byte) to ``stop``, the
    first of them line ``line`` (what a worker of a parallel conversion reads: :func:`line_spans`)."""

    start: int
    stop: int
    line: int


def iter_jsonl(path: PathLike, what: str = "JSON objects", span: Optional[Span] = None) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, object)`` for each non-blank line (of ``span``, else of the whole file,
    which must hold one); raise DataError on bad input."""
    p = Path(path)
    if not p.exists():
        raise _error(p, None, f"no such file (expected a JSONL file of {what})")
    if not p.is_file():
        raise _error(p, None, f"not a regular file (expected a JSONL file of {what})")
    n = 0
    for lineno, line in text_lines(p, span):
        try:
            obj = _loads(line)
        except json.JSONDecodeError as exc:
            raise _error(
                p, lineno, f"malformed JSON ({exc.msg}: column {exc.colno}); expected one JSON object per line"
            ) from None
        if not isinstance(obj, dict):
            raise _error(p, lineno, f"expected a JSON object, got {_type_name(obj)}")
        n += 1
        yield lineno, obj
    if n == 0 and span is None:
        raise _error(p, None, f"empty file (expected at least one line of {what})")


def text_lines(path: Path, span: Optional[Span] = None) -> Iterator[tuple[int, str]]:
    """``(line_number, line)`` for each non-blank line of ``path`` (of ``span``), decoded as UTF-8 (a
    leading byte-order mark dropped); a line that is not UTF-8 is a DataError naming it."""
    start, stop, first = (span.start, span.stop, span.line) if span else (0, None, 1)
    with open(path, "rb") as fh:
        fh.seek(start)
        at = start
        for lineno, raw in enumerate(fh, start=first):
            if stop is not None and at >= stop:
                return
            at += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _error(path, lineno, f"not valid UTF-8 ({exc.reason})") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if line.strip():
                yield lineno, line


def line_spans(path: Path, n: int) -> list[Span]:
    """``path`` cut into at most ``n`` spans of about equal bytes, each starting at a line's first byte
    (a cut inside a line moves to the next line; one falling inside a line that holds two cuts is
    dropped), numbered as the whole file numbers them."""
    size = path.stat().st_size
    starts = [0]
    with open(path, "rb") as fh:
        for k in range(1, n):
            if size * k // n - 1 < starts[-1]:
                continue  # the cut is in the line that moved the one before past it
            fh.seek(size * k // n - 1)
            fh.readline()  # to the end of the line holding the byte before the cut
            if fh.tell() < size:
                starts.append(fh.tell())
        lines = [1]
        fh.seek(0)
        for a, b in zip(starts, starts[1:]):  # newlines before each start: its first line's number
            lines.append(lines[-1] + sum(fh.read(min(1 << 22, b - at)).count(b"\n") for at in range(a, b, 1 << 22)))
    return [Span(a, b, line) for a, b, line in zip(starts, starts[1:] + [size], lines)]


def _loads(line: str) -> Any:
    """``json.loads`` through orjson (a few times faster); anything it refuses, e.g. NaN or integers
    beyond 64 bits, goes to json, which decides and words the error."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _req_str(obj: dict, key: str, path: PathLike, line: int, allow_empty: bool = False) -> str:
    if key not in obj or obj[key] is None:
        raise _error(path, line, f"missing field {key!r} (expected a non-empty string)")
    v = obj[key]
    if not isinstance(v, str):
        raise _error(path, line, f"field {key!r} must be a string, got {_type_name(v)}")
    if not allow_empty and not v.strip():
        raise _error(path, line, f"field {key!r} is empty (expected a non-empty string)")
    return v


def _id_str(obj: dict, key: str, path: PathLike, line: int, required: bool) -> Optional[str]:
    """An id given as a string (or an integer, kept as its decimal string)."""
    if key not in obj or obj[key] is None:
        if required:
            raise _error(path, line, f"missing field {key!r} (expected a string id)")
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _error(path, line, f"field {key!r} must be a string id, got {_type_name(v)}")
    s = str(v)
    if not s.strip():
        raise _error(path, line, f"field {key!r} is empty (expected a non-empty id)")
    return s


def _hashed_id(v: Any, key: str, path: PathLike, line: int, allow_none_group: bool) -> int:
    """String -> stable_id; integer in [0, 2**63) (or -1 for groups) -> as is."""
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _error(path, line, f"field {key!r} must be a string or an integer id, got {_type_name(v)}")
    if isinstance(v, int):
        lo = -1 if allow_none_group else 0
        if not lo <= v <= _MAX_ID:
            raise _error(path, line, f"field {key!r}: integer id {v} out of range [{lo}, 2**63)")
        return v
    if not v.strip():
        raise _error(path, line, f"field {key!r} is empty (expected a non-empty id)")
    return stable_id(v)


def _opt_number(obj: dict, key: str, path: PathLike, line: int, label: Optional[str] = None) -> Optional[float]:
    v, label = obj.get(key), label or key
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _error(path, line, f"field {label!r} must be a number, got {_type_name(v)}")
    if not math.isfinite(v):  # (json reads NaN and Infinity) a teacher's NaN would make the distilled loss NaN
        raise _error(path, line, f"field {label!r} is {v}; expected a finite number")
    return float(v)


def _negative_scores(obj: dict, negatives: list[Negative], path: PathLike, line: int) -> list[Negative]:
    """``negatives`` with the row's ``negative_scores`` (one per negative) as their scores."""
    v = obj["negative_scores"]
    if not isinstance(v, list):
        raise _error(path, line, f"field 'negative_scores' must be a list of numbers, got {_type_name(v)}")
    if len(v) != len(negatives):
        raise _error(path, line, f"field 'negative_scores' holds {len(v)} scores for {len(negatives)} hard negatives; "
                                 "expected one score per negative, in their order")
    if any(n.score is not None for n in negatives):
        raise _error(path, line, "field 'negative_scores' and a negative's own 'score' both given; expected the "
                                 "teacher's scores once (either the list or each negative's score)")
    for i, score in enumerate(v):
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            shown = score if isinstance(score, float) else _type_name(score)
            raise _error(path, line, f"field 'negative_scores': score {i} is {shown}; expected a finite number")
    scores = [float(x) for x in v]
    return [replace(n, score=s) for n, s in zip(negatives, scores)]


def _parse_negatives(v: Any, path: PathLike, line: int) -> list[Negative]:
    if not isinstance(v, list):
        raise _error(path, line, f"field 'negatives' must be a list of texts or objects, got {_type_name(v)}")
    out: list[Negative] = []
    for i, item in enumerate(v):
        key = f"negatives[{i}]"
        if isinstance(item, str):
            if not item.strip():
                raise _error(path, line, f"{key} is an empty string (expected a non-empty text)")
            out.append(Negative(doc_id=doc_id_for_text(item), text=item))
        elif isinstance(item, dict):
            if "text" not in item or item["text"] is None:
                raise _error(path, line, f"{key}: missing field 'text' (expected a non-empty string)")
            text = item["text"]
            if not isinstance(text, str):
                raise _error(path, line, f"{key}.text must be a string, got {_type_name(text)}")
            if not text.strip():
                raise _error(path, line, f"{key}.text is empty (expected a non-empty string)")
            did = (
                _hashed_id(item["doc_id"], f"{key}.doc_id", path, line, False)
                if item.get("doc_id") is not None
                else doc_id_for_text(text)
            )
            grp = (
                _hashed_id(item["group"], f"{key}.group", path, line, True)
                if item.get("group") is not None
                else NO_GROUP
            )
            out.append(Negative(doc_id=did, text=text, score=_opt_number(item, "score", path, line, f"{key}.score"), group=grp,
                                given_doc_id=item.get("doc_id"), given_group=item.get("group")))
        else:
            raise _error(path, line, f"{key} must be a string or an object with 'text', got {_type_name(item)}")
    return out


def pair_from_json(obj: dict, path: PathLike = "<pairs>", line: int = 0) -> Pair:
    """One JSONL object -> :class:`Pair` (see the module docstring for the fields)."""
    query = _req_str(obj, "query", path, line)
    positive = _req_str(obj, "positive", path, line)
    did = (
        _hashed_id(obj["doc_id"], "doc_id", path, line, False)
        if obj.get("doc_id") is not None
        else doc_id_for_text(positive)
    )
    grp = _hashed_id(obj["group"], "group", path, line, True) if obj.get("group") is not None else NO_GROUP
    negatives = _parse_negatives(obj["negatives"], path, line) if obj.get("negatives") is not None else []
    if obj.get("negative_scores") is not None:
        negatives = _negative_scores(obj, negatives, path, line)
    return Pair(
        query=query,
        positive=positive,
        doc_id=did,
        group=grp,
        query_id=_id_str(obj, "query_id", path, line, required=False),
        negatives=negatives,
        positive_score=_opt_number(obj, "positive_score", path, line),
        given_doc_id=obj.get("doc_id"),
        given_group=obj.get("group"),
    )


def read_pairs_jsonl(path: PathLike) -> list[Pair]:
    """Read training pairs; raise :class:`DataError` (file, line, expected) on any bad line."""
    return [pair for _, pair in read_pairs_jsonl_located(path)]


def read_pairs_jsonl_located(path: PathLike) -> list[tuple[int, Pair]]:
    """Like :func:`read_pairs_jsonl`, with each pair's line number (for later error messages)."""
    return list(iter_pairs_jsonl_located(path))


def iter_pairs_jsonl_located(path: PathLike, span: Optional[Span] = None) -> Iterator[tuple[int, Pair]]:
    """``(line, pair)`` of each line, streamed (the conversion into a store reads files this way).

    A given ``doc_id`` names one document: the same id on two lines with different positive texts
    is an error naming both lines (those documents would mask each other as false negatives); the lines
    of a ``span`` are not checked here: a parallel conversion checks its parts together
    (:func:`doc_id_conflict`)."""
    given: dict[int, tuple[int, int]] = {}  # doc_id -> (first line, id of its positive's text)
    for line, obj in iter_jsonl(path, "training pairs", span):
        pair = pair_from_json(obj, path, line)
        if span is None and obj.get("doc_id") is not None:
            first, text_id = given.setdefault(pair.doc_id, (line, doc_id_for_text(pair.positive)))
            if text_id != doc_id_for_text(pair.positive):
                raise _doc_id_conflict(path, line, obj["doc_id"], first)
        yield line, pair


def _doc_id_conflict(path: PathLike, line: int, given: Any, first: int) -> DataError:
    return _error(path, line, f"doc_id {given!r} is also on line {first} with a different 'positive' text; "
                              "expected one text per doc_id (give the two documents different ids, or leave doc_id out "
                              "to derive it from the text)")


def doc_id_conflict(path: PathLike, doc_ids: Any, text_ids: Any, lines: Any, spans: list[Span]) -> Optional[DataError]:
    """The error :func:`iter_pairs_jsonl_located` raises first over the whole file, from the rows with
    a given ``doc_id`` of its ``spans`` (in file order: their ids, their positives' text ids, their
    lines); None when no id has two texts."""
    import numpy as np

    doc_ids, text_ids, lines = (np.asarray(a, dtype=np.int64) for a in (doc_ids, text_ids, lines))
    order = np.lexsort((lines, doc_ids))  # by id, then line: each id's first line leads its run
    d, t, l = doc_ids[order], text_ids[order], lines[order]
    lead = np.maximum.accumulate(np.where(np.r_[True, d[1:] != d[:-1]], np.arange(len(d)), 0))
    bad = np.flatnonzero(t != t[lead])
    if not len(bad):
        return None
    k = bad[np.argmin(l[bad])]
    line = int(l[k])
    span = next(s for s in reversed(spans) if s.line <= line)
    given = next(obj["doc_id"] for at, obj in iter_jsonl(path, "training pairs", span) if at == line)
    return _doc_id_conflict(path, line, given, int(l[lead[k]]))


def _given(given: Any, hashed: int) -> Any:
    """An id as the data gave it, else its integer (both read back to the same id)."""
    return given if given is not None else int(hashed)


def pair_to_json(pair: Pair) -> dict:
    obj: dict[str, Any] = {"query": pair.query, "positive": pair.positive, "doc_id": _given(pair.given_doc_id, pair.doc_id)}
    if pair.group != NO_GROUP:
        obj["group"] = _given(pair.given_group, pair.group)
    if pair.query_id is not None:
        obj["query_id"] = pair.query_id
    if pair.positive_score is not None:
        obj["positive_score"] = pair.positive_score
    if pair.negatives:
        negs = []
        for n in pair.negatives:
            d: dict[str, Any] = {"doc_id": _given(n.given_doc_id, n.doc_id), "text": n.text}
            if n.score is not None:
                d["score"] = n.score
            if n.group != NO_GROUP:
                d["group"] = _given(n.given_group, n.group)
            negs.append(d)
        obj["negatives"] = negs
    return obj


def write_jsonl(path: PathLike, records: Iterable[dict]) -> int:
    """Write dicts one a line (UTF-8, ``\\n`` endings, key order kept); return the count."""
    n = 0
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False))
            fh.write("\n")
            n += 1
    return n


def write_pairs_jsonl(path: PathLike, pairs: Iterable[Pair]) -> int:
    """Write pairs so that :func:`read_pairs_jsonl` gives them back equal (ids as given, else as integers)."""
    return write_jsonl(path, (pair_to_json(p) for p in pairs))


# ------------------------------------------------------------------------------------------ BEIR


def beir_doc_text(title: str, text: str) -> str:
    """The document text of a BEIR corpus entry (see the module docstring)."""
    title, text = (title or "").strip(), (text or "").strip()
    if not title:
        return text
    if not text:
        return title
    sep = " " if title[-1] in ".!?:;" else ". "
    return title + sep + text


def _check_id_token(did: str, path: Path, line: int) -> str:
    """BEIR ids go into TREC run and qrels files, whose fields are separated by whitespace."""
    if any(c.isspace() for c in did):
        raise _error(path, line, f"_id {did!r} contains whitespace; expected an id without spaces, tabs or "
                                 "newlines (TREC run files cannot hold it)")
    return did


def iter_corpus_located(path: PathLike) -> Iterator[tuple[int, str, str, Optional[int]]]:
    """A BEIR ``corpus.jsonl``, validated as it streams: ``(line, _id, document text, group or None)``
    (only the ids are kept, to find duplicates)."""
    path = Path(path)
    first_line: dict[str, int] = {}
    for line, obj in iter_jsonl(path, "corpus documents {'_id', 'title', 'text'}"):
        did = _check_id_token(_id_str(obj, "_id", path, line, required=True), path, line)
        text = _req_str(obj, "text", path, line, allow_empty=True)
        title = obj.get("title")
        if title is None:
            title = ""
        if not isinstance(title, str):
            raise _error(path, line, f"field 'title' must be a string, got {_type_name(title)}")
        doc = beir_doc_text(title, text)
        if not doc:
            raise _error(path, line, f"document {did!r} has an empty 'title' and 'text' (expected some text)")
        if did in first_line:
            raise _error(path, line, f"duplicate _id {did!r} (first on line {first_line[did]}); expected unique ids")
        first_line[did] = line
        group = None if obj.get("group") is None else _hashed_id(obj["group"], "group", path, line, True)
        yield line, did, doc, group


def _read_corpus(path: Path) -> tuple[dict[str, str], dict[str, int]]:
    corpus: dict[str, str] = {}
    groups: dict[str, int] = {}
    for _, did, doc, group in iter_corpus_located(path):
        corpus[did] = doc
        if group is not None:
            groups[did] = group
    return corpus, groups


def read_corpus(path: PathLike) -> dict[str, str]:
    """A BEIR ``corpus.jsonl``, validated: ``{_id: document text}`` (text as in :func:`read_beir`)."""
    return _read_corpus(Path(path))[0]


def _read_queries(path: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line, obj in iter_jsonl(path, "queries {'_id', 'text'}"):
        qid = _check_id_token(_id_str(obj, "_id", path, line, required=True), path, line)
        text = _req_str(obj, "text", path, line)
        if qid in queries:
            raise _error(path, line, f"duplicate _id {qid!r} (first on line {first_line[qid]}); expected unique ids")
        first_line[qid] = line
        queries[qid] = text
    return queries


def _read_qrels(
    path: Path, corpus: Any, queries: dict[str, str], corpus_path: Path, queries_path: Path
) -> dict[str, dict[str, int]]:
    if not path.is_file():
        avail = sorted(p.stem for p in path.parent.glob("*.tsv")) if path.parent.is_dir() else []
        raise _error(path, None, f"no such file (expected qrels for this split; splits present: {avail or 'none'})")
    qrels: dict[str, dict[str, int]] = {}
    header_seen = False
    expected_header = "\t".join(QRELS_HEADER)
    for lineno, line in text_lines(path):
        line = line.rstrip("\r\n")
        cols = line.split("\t")
        if not header_seen:
            names = tuple(c.strip().lower().replace("_", "-") for c in cols)
            if names != QRELS_HEADER:
                raise _error(path, lineno, f"bad header {line!r}; expected {expected_header!r} (tab-separated)")
            header_seen = True
            continue
        if len(cols) != 3:
            raise _error(
                path, lineno, f"expected 3 tab-separated columns (query-id, corpus-id, score), got {len(cols)}: {line!r}"
            )
        qid, did, s = (c.strip() for c in cols)
        try:
            fs = float(s)
            if fs != int(fs):
                raise ValueError
            score = int(fs)
        except (ValueError, OverflowError):
            raise _error(path, lineno, f"score {s!r} is not an integer") from None
        if qid not in queries:
            raise _error(path, lineno, f"query-id {qid!r} is not in {queries_path}")
        if did not in corpus:
            raise _error(path, lineno, f"corpus-id {did!r} is not in {corpus_path}")
        row = qrels.setdefault(qid, {})
        if did in row:
            raise _error(path, lineno, f"duplicate judgment for ({qid!r}, {did!r})")
        row[did] = score
    if not header_seen:
        raise _error(path, None, f"empty file (expected the header {expected_header!r} and judgments)")
    if not qrels:
        raise _error(path, None, "no judgments after the header (expected query-id, corpus-id, score rows)")
    return qrels


def read_beir(directory: PathLike, split: str = "test", corpus_reader: Any = None) -> EvalSet:
    """Read a BEIR directory for one split (see the module docstring; ``corpus_reader``: as in
    :func:`read_beir_splits`)."""
    return read_beir_splits(directory, [split], corpus_reader)[split]


def read_beir_splits(directory: PathLike, splits: Iterable[str], corpus_reader: Any = None) -> dict[str, EvalSet]:
    """Read several splits of one BEIR directory, reading (and sharing) the corpus once.
    ``corpus_reader(path) -> (corpus, {doc id: group})``: how corpus.jsonl is read (default: into a
    dict; corpus_store.read_corpus_store: a memory-mapped store with ``len``, ``in`` and ``doc_ids``)."""
    d = Path(directory)
    if not d.is_dir():
        raise _error(d, None, "no such directory (expected a BEIR folder with corpus.jsonl, queries.jsonl, qrels/)")
    corpus_path, queries_path = d / "corpus.jsonl", d / "queries.jsonl"
    corpus, groups = (corpus_reader or _read_corpus)(corpus_path)
    queries = _read_queries(queries_path)
    out: dict[str, EvalSet] = {}
    for split in splits:
        qrels_path = d / "qrels" / f"{split}.tsv"
        qrels = _read_qrels(qrels_path, corpus, queries, corpus_path, queries_path)
        kept = {q: rel for q, rel in qrels.items() if any(v > 0 for v in rel.values())}
        if not kept:
            raise _error(qrels_path, None, "no query has a judgment with score > 0 (expected at least one relevant pair)")
        out[split] = EvalSet(
            corpus=corpus,
            queries={q: queries[q] for q in kept},
            qrels=kept,
            doc_groups=groups or None,
        )
    return out


def beir_train_pairs(evalset: EvalSet) -> list[Pair]:
    """Training pairs from the qrels (score > 0), in qrels order; ``doc_id = stable_id(corpus _id)``."""
    groups = evalset.doc_groups or {}
    pairs = []
    for qid, rel in evalset.qrels.items():
        for did, score in rel.items():
            if score > 0:
                pairs.append(
                    Pair(
                        query=evalset.queries[qid],
                        positive=evalset.corpus[did],
                        doc_id=stable_id(did),
                        group=groups.get(did, NO_GROUP),
                        query_id=qid,
                        given_doc_id=did,
                    )
                )
    return pairs


def write_beir(directory: PathLike, evalset: EvalSet, split: str = "test") -> None:
    """Write ``evalset`` in the BEIR layout (``title`` empty; ``group`` as an integer when known)."""
    d = Path(directory)
    (d / "qrels").mkdir(parents=True, exist_ok=True)
    groups = evalset.doc_groups or {}

    def docs():
        for did, text in evalset.corpus.items():
            rec: dict[str, Any] = {"_id": did, "title": "", "text": text}
            if did in groups:
                rec["group"] = int(groups[did])
            yield rec

    write_jsonl(d / "corpus.jsonl", docs())
    write_jsonl(d / "queries.jsonl", ({"_id": q, "text": t} for q, t in evalset.queries.items()))
    write_qrels(d / "qrels" / f"{split}.tsv", evalset.qrels)


def write_qrels(path: PathLike, qrels: dict[str, dict[str, int]]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("\t".join(QRELS_HEADER) + "\n")
        for qid, rel in qrels.items():
            for did, score in rel.items():
                if any(c in str(x) for x in (qid, did) for c in "\t\r\n"):
                    raise ValueError(f"qrels ids may not contain tabs or newlines: {qid!r}, {did!r}")
                fh.write(f"{qid}\t{did}\t{int(score)}\n")


__all__ = [
    "DataError",
    "Negative",
    "Pair",
    "EvalSet",
    "Span",
    "iter_jsonl",
    "text_lines",
    "line_spans",
    "pair_from_json",
    "pair_to_json",
    "read_pairs_jsonl",
    "read_pairs_jsonl_located",
    "iter_pairs_jsonl_located",
    "doc_id_conflict",
    "write_jsonl",
    "write_pairs_jsonl",
    "beir_doc_text",
    "read_corpus",
    "iter_corpus_located",
    "read_beir",
    "read_beir_splits",
    "beir_train_pairs",
    "write_beir",
    "write_qrels",
]
