"""The standard-library docstring builder (``python -m moco_retrieval.data pydoc``): a fixed tiny
library written here (our own text), located errors, a split by package that is stable and keeps
every group on one side, and a build from a few modules of the real installed library."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from moco_retrieval.data.__main__ import main as data_main
from moco_retrieval.data.builders.debian import is_eval_source
from moco_retrieval.data.formats import DataError, read_beir, read_pairs_jsonl
from moco_retrieval.data.builders.stdlib_docs import build_stdlib_docs, pair_from_docstring, split_summary

FRACTION = 0.6  # with it, package "alpha" (and "epsilon") is held out, "beta" and "gamma" train

ALPHA = '''
"""Tools for counting apples in baskets.

The counting works on any iterable of baskets and returns a plain integer
that sums every apple found.
"""


def count(baskets):
    """Count the apples in every basket given.

    Each basket is an iterable of fruit names; only the name apple counts.
    Other fruit is ignored without a warning.
    """


def _hidden(x):
    """A private helper that must not appear in the output at all.

    Even with a long enough description it is skipped by its name.
    """


def short():
    """Return one."""


def signature(a, b):
    """signature(a, b) -> int

    The first line is a call signature, so this docstring gives no query.
    """


class Basket:
    """A basket that holds fruit for the counting tools.

    Fruit is added with add and removed with take; the basket keeps its
    fruit in the order it was added.
    """

    def add(self, fruit):
        """Put one fruit into the basket. It goes on top of the others and
        is the first one that take returns afterwards, like a stack."""
'''

BETA = '''
def tally(baskets):
    """Count the apples in every basket given.

    This summary repeats alpha's: the pair is a duplicate and is dropped.
    """


def weigh(fruit):
    """Weigh a fruit on the kitchen scale, in grams.

    The scale is read twice and the mean of both readings is returned to
    the caller as a float.
    """
'''

GAMMA_INIT = '''
"""A package of orchard utilities for pickers and planners.

It groups the modules that plan where trees go and when fruit is picked.
"""
'''

GAMMA_SUB = '''
def plan(rows):
    """Plan the rows of an orchard from a list of tree kinds.

    Trees of one kind go into one row, and rows alternate between early and
    late flowering kinds so that bees find food all season.
    """
'''

EPSILON = '''
def prune(tree):
    """Prune a tree back to its strongest five branches.

    The weakest branches are cut first, then crossing ones, until five are
    left; the cut branches are returned as a list.
    """
'''


def write_library(root: Path, **extra: str) -> Path:
    files = {"alpha.py": ALPHA, "beta.py": BETA, "gamma/__init__.py": GAMMA_INIT, "gamma/sub.py": GAMMA_SUB,
             "test/test_alpha.py": GAMMA_SUB.replace("plan", "plan_test"),
             "site-packages/thirdparty.py": EPSILON, **extra}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return root


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_builds_the_expected_pairs_from_a_fixed_library(tmp_path):
    lib = write_library(tmp_path / "lib")
    manifest = build_stdlib_docs(tmp_path / "out", lib, eval_fraction=FRACTION)
    train = rows(tmp_path / "out" / "train.jsonl")
    assert [r["query_id"] for r in train] == ["beta:weigh", "gamma", "gamma.sub:plan"]
    assert [r["group"] for r in train] == ["beta", "gamma", "gamma.sub"]
    assert train[0] == {
        "query": "Weigh a fruit on the kitchen scale, in grams.",
        "positive": "The scale is read twice and the mean of both readings is returned to\nthe caller as a float.",
        "query_id": "beta:weigh", "doc_id": "beta:weigh", "group": "beta",
    }
    ev = read_beir(tmp_path / "out" / "eval", "test")
    assert sorted(ev.queries) == ["alpha", "alpha:Basket", "alpha:Basket.add", "alpha:count"]
    assert ev.queries["alpha:Basket.add"] == "Put one fruit into the basket."
    assert ev.corpus["alpha:Basket.add"].startswith("It goes on top of the others and is the first one")
    assert ev.qrels["alpha:count"] == {"alpha:count": 1} and ev.doc_groups is not None
    c = manifest["counts"]
    assert c["modules"] == 4  # test/ and site-packages/ skipped
    assert c["duplicate_query_dropped"] == 1  # beta:tally repeats alpha:count's summary
    assert c["trivial_dropped"] == 2  # short (one sentence), signature; _hidden is never read
    assert (c["train_pairs"], c["eval_queries"], c["train_packages"], c["eval_packages"]) == (3, 4, 2, 1)
    # the training file is what data=jsonl reads
    assert [p.query for p in read_pairs_jsonl(tmp_path / "out" / "train.jsonl")] == [r["query"] for r in train]


def test_same_library_gives_byte_identical_output(tmp_path):
    lib = write_library(tmp_path / "lib")
    a = build_stdlib_docs(tmp_path / "a", lib, eval_fraction=FRACTION)
    b = build_stdlib_docs(tmp_path / "b", lib, eval_fraction=FRACTION)
    assert a["files"] == b["files"] and a["inputs"]["files_sha256"] == b["inputs"]["files_sha256"]
    build_stdlib_docs(tmp_path / "a", lib, eval_fraction=FRACTION)  # a previous build is replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(DataError, match="not empty and not a previous build"):
        build_stdlib_docs(tmp_path / "mine", lib)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "a user's file"


def test_split_by_package_is_stable_and_keeps_groups_on_one_side(tmp_path):
    lib = write_library(tmp_path / "lib")
    build_stdlib_docs(tmp_path / "before", lib, eval_fraction=FRACTION)
    write_library(lib, **{"epsilon.py": EPSILON})  # a new package comes
    build_stdlib_docs(tmp_path / "after", lib, eval_fraction=FRACTION)

    def sides(out):
        train = {r["query_id"]: r["group"] for r in rows(out / "train.jsonl")}
        corpus = {r["_id"]: r["group"] for r in rows(out / "eval" / "corpus.jsonl")}
        return train, corpus

    train0, eval0 = sides(tmp_path / "before")
    train1, eval1 = sides(tmp_path / "after")
    assert set(train0) <= set(train1) and set(eval0) <= set(eval1)  # nothing changed side
    assert set(eval1) - set(eval0) == {"epsilon:prune"}
    assert not set(train1.values()) & set(eval1.values())  # no group on both sides
    for qid in train1:
        assert not is_eval_source(qid.split(":")[0].split(".")[0], FRACTION)
    for qid in eval1:
        assert is_eval_source(qid.split(":")[0].split(".")[0], FRACTION)


def test_errors_name_the_file_line_or_module(tmp_path):
    lib = write_library(tmp_path / "lib", **{"broken.py": 'def f(:\n    """Doc."""\n'})
    with pytest.raises(DataError, match=rf"{lib / 'broken.py'}:1: cannot parse as Python"):
        build_stdlib_docs(tmp_path / "out", lib)
    with pytest.raises(DataError, match=r"module 'nosuch.mod': no .*nosuch/mod.py or .*nosuch/mod/__init__.py"):
        build_stdlib_docs(tmp_path / "out", lib, modules=["alpha", "nosuch.mod"])
    (lib / "latin.py").write_bytes(b'"""Docs.\n\nCaf\xe9 au lait."""\n')
    with pytest.raises(DataError, match=rf"{lib / 'latin.py'}:3: not valid UTF-8"):
        build_stdlib_docs(tmp_path / "out", lib, modules=["latin"])
    with pytest.raises(DataError, match="no such directory"):
        build_stdlib_docs(tmp_path / "out", tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"falls on the training side at eval_fraction=0.6; read more modules"):
        build_stdlib_docs(tmp_path / "out", lib, modules=["beta", "gamma"], eval_fraction=FRACTION)
    assert not (tmp_path / "out").exists()


def test_command_line(tmp_path, capsys):
    lib = write_library(tmp_path / "lib")
    out = tmp_path / "out"
    assert data_main(["pydoc", "--out", str(out), "--stdlib", str(lib), "--modules", "alpha,gamma.sub",
                      "--eval-fraction", str(FRACTION)]) == 0
    assert "wrote" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"]["modules"] == ["alpha", "gamma.sub"] and manifest["counts"]["pairs"] == 5
    with pytest.raises(SystemExit) as stop:
        data_main(["pydoc", "--out", str(out), "--stdlib", str(lib), "--modules", "nosuch"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("data pydoc: error: module 'nosuch'")


def test_summary_split_and_trivial_docstrings():
    assert split_summary("Return the thing\n  wrapped. More words.\n\nSecond.") == (
        "Return the thing wrapped.", "More words.\n\nSecond.")
    assert split_summary("Use e.g. this. Then that.")[0] == "Use e.g. this."
    assert pair_from_docstring("Return one.") is None
    assert pair_from_docstring("Too short.\n\nBut the document is long enough to keep here.") is None
    assert pair_from_docstring("A long enough summary.\n\nToo short a document.") is None


def test_a_few_modules_of_the_installed_library(tmp_path):
    modules = ["json", "json.decoder", "textwrap", "shlex"]
    manifest = build_stdlib_docs(tmp_path / "out", modules=modules, eval_fraction=0.3)  # json held out
    train = read_pairs_jsonl(tmp_path / "out" / "train.jsonl")
    ev = read_beir(tmp_path / "out" / "eval", "test")
    ids = [p.query_id for p in train] + list(ev.queries)
    assert len(ids) == manifest["counts"]["pairs"] >= 10
    assert {i.split(":")[0] for i in ids} <= set(modules)
    assert "textwrap:dedent" in ids and all(i.startswith("json") for i in ev.queries)
    assert manifest["inputs"]["stdlib"].startswith("Python ")
