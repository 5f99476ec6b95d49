"""The Debian builder on hand-written control files (and, when present, on the shared snapshot)."""
import gzip
import hashlib
import json
import lzma
import re
from pathlib import Path

import pytest

from moco_retrieval.config import DataConfig
from moco_retrieval.data.__main__ import main as cli_main
from moco_retrieval.data.builders.debian import (
    ENV_DEBIAN_DIR,
    RECORD_FILE,
    build_debian,
    ensure_debian_dataset,
    find_index_files,
    is_eval_source,
    parse_description,
    read_index_text,
)
from moco_retrieval.data.formats import DataError, read_beir, read_pairs_jsonl
from moco_retrieval.data.ids import stable_id
from tests.helpers import SHARED_DEBIAN, deny


# (package, Source field or None, Description-en, in Packages?)
ENTRIES = [
    ("alpha", "alpha-src (1.0-1)", "Alpha tool\n First paragraph line one\n line two\n .\n Second paragraph", True),
    ("alpha-data", "alpha-src", "Alpha tool (data)\n First paragraph  line one\n line two\n .\n This package has the data.", True),
    ("beta", None, "Beta tool\n Beta does things.", True),
    ("delta", "delta", "Delta tool\n Beta does things.", True),  # exact duplicate document of beta
    ("gamma", None, "beta TOOL\n Gamma is different.", True),  # duplicate query of beta (case, spaces)
    ("emptydesc", None, "Nothing more", True),  # no long description
    ("orphan", None, "Orphan tool\n Only in Translation-en.", False),  # no Packages entry
    ("verbatim", "verb-src (2:1.2)", "Verbatim\n Intro:\n  * item one\n  * item two\n .\n .\n End.", True),
] + [(f"pkg{i:02d}", f"src{i % 10:02d}" if i % 3 else None, f"Tool number {i}\n Long text {i}.", True) for i in range(30)]


def md5_of(desc: str) -> str:
    return hashlib.md5((desc + "\n").encode()).hexdigest()


def write_control(d: Path, compress=None, reverse=False) -> tuple[Path, Path]:
    d.mkdir(parents=True, exist_ok=True)
    entries = list(reversed(ENTRIES)) if reverse else ENTRIES
    tr = "".join(f"Package: {p}\nDescription-md5: {md5_of(desc)}\nDescription-en: {desc}\n\n" for p, _, desc, _ in entries)
    pk = ""
    for p, src, desc, in_pk in entries:
        if not in_pk:
            continue
        pk += f"Package: {p}\n" + (f"Source: {src}\n" if src else "") + "Version: 1.0\nArchitecture: amd64\n"
        pk += f"Description: {desc.splitlines()[0]}\nDescription-md5: {md5_of(desc)}\nTag: role::program,\n use::test\n\n"
    files = []
    for name, text in (("Translation-en", tr), ("Packages", pk)):
        data = text.encode()
        if compress == "xz":
            name, data = name + ".xz", lzma.compress(data)
        elif compress == "gz":
            name, data = name + ".gz", gzip.compress(data, mtime=0)
        (d / name).write_bytes(data)
        files.append(d / name)
    return files[0], files[1]


def load(out: Path):
    train = read_pairs_jsonl(out / "train.jsonl")
    raw_train = [json.loads(l) for l in (out / "train.jsonl").read_text().splitlines()]
    ev = read_beir(out / "eval", "test")
    corpus = [json.loads(l) for l in (out / "eval" / "corpus.jsonl").read_text().splitlines()]
    return train, raw_train, ev, corpus, json.loads((out / "manifest.json").read_text())


def test_parse_description():
    short, long = parse_description("Short one \n First line\n second\n .\n Para two\n  verbatim\n .")
    assert short == "Short one"
    assert long == "First line\nsecond\n\nPara two\n verbatim"


def test_builder_on_control_files(tmp_path):
    tr, pk = write_control(tmp_path / "in")
    m = build_debian(tmp_path / "out", [tr], [pk], eval_fraction=0.4)
    train, raw_train, ev, corpus, manifest = load(tmp_path / "out")
    rows = {r["query_id"]: r for r in raw_train}
    rows.update({c["_id"]: {"group": c["group"], "positive": c["text"], "query": ev.queries[c["_id"]]} for c in corpus})
    # kept: alpha (alpha-data drops: same first paragraph), beta (delta: same document; gamma: same
    # query), verbatim, the 30 pkgNN; dropped: emptydesc (no long description), orphan (no Packages)
    assert set(rows) == {"alpha", "beta", "verbatim"} | {f"pkg{i:02d}" for i in range(30)}
    assert rows["alpha"]["query"] == "Alpha tool"
    assert rows["alpha"]["positive"] == "First paragraph line one\nline two\n\nSecond paragraph"
    assert rows["alpha"]["group"] == "alpha-src"  # version in parentheses stripped
    assert rows["beta"]["group"] == "beta"  # no Source: the package name
    assert rows["beta"]["positive"] == "Beta does things."
    assert rows["verbatim"]["group"] == "verb-src"
    assert rows["verbatim"]["positive"] == "Intro:\n * item one\n * item two\n\nEnd."
    assert rows["pkg03"]["group"] == "pkg03" and rows["pkg04"]["group"] == "src04"
    c = m["counts"]
    assert c["duplicate_document_dropped"] == 2 and c["duplicate_query_dropped"] == 1
    assert c["empty_description_dropped"] == 1 and c["translations_without_packages_entry"] == 1
    assert c["pairs"] == 33 and c["train_pairs"] + c["eval_queries"] == 33
    # split invariants: by source, each source on one side, both sides used
    train_src = {r["group"] for r in raw_train}
    eval_src = {x["group"] for x in corpus}
    assert train_src and eval_src and not train_src & eval_src
    assert all(not is_eval_source(s, 0.4) for s in train_src) and all(is_eval_source(s, 0.4) for s in eval_src)
    # ids and groups as the training code sees them
    t = {p.query_id: p for p in train}
    for qid, p in t.items():
        assert p.doc_id == stable_id(qid) and p.group == stable_id(rows[qid]["group"])
    assert ev.qrels == {q: {q: 1} for q in ev.queries} and set(ev.corpus) == set(ev.queries)
    assert ev.doc_groups == {d: stable_id(rows[d]["group"]) for d in ev.corpus}
    assert manifest["inputs"]["translation"][0]["sha256"] == hashlib.sha256(tr.read_bytes()).hexdigest()
    assert "split_rule" in manifest and manifest["options"]["eval_fraction"] == 0.4


def test_exact_dedup_keeps_near_duplicates(tmp_path):
    tr, pk = write_control(tmp_path / "in")
    m = build_debian(tmp_path / "out", [tr], [pk], eval_fraction=0.4, dedup="exact")
    assert m["counts"]["pairs"] == 34  # alpha-data stays: its document differs after the first paragraph


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_deterministic_and_compressed_inputs(tmp_path):
    tr, pk = write_control(tmp_path / "a")
    build_debian(tmp_path / "o1", [tr], [pk], eval_fraction=0.4)
    # same inputs written in reverse stanza order in another folder: byte-identical outputs
    tr2, pk2 = write_control(tmp_path / "b", reverse=True)
    build_debian(tmp_path / "o2", [tr2], [pk2], eval_fraction=0.4)
    t1, t2 = _tree(tmp_path / "o1"), _tree(tmp_path / "o2")
    assert set(t1) == {"manifest.json", "train.jsonl", "eval/corpus.jsonl", "eval/queries.jsonl", "eval/qrels/test.tsv"}
    assert {k: v for k, v in t1.items() if k != "manifest.json"} == {k: v for k, v in t2.items() if k != "manifest.json"}
    # rebuilding over a previous build with the very same files: every byte equal, manifest too
    build_debian(tmp_path / "o1", [tr], [pk], eval_fraction=0.4)
    assert _tree(tmp_path / "o1") == t1
    for comp in ("xz", "gz"):
        trc, pkc = write_control(tmp_path / comp, compress=comp)
        assert read_index_text(trc) == read_index_text(tr)
        build_debian(tmp_path / f"o-{comp}", [trc], [pkc], eval_fraction=0.4)
        tc = _tree(tmp_path / f"o-{comp}")
        assert {k: v for k, v in tc.items() if k != "manifest.json"} == {k: v for k, v in t1.items() if k != "manifest.json"}


def test_refuses_to_clobber_foreign_folder(tmp_path):
    tr, pk = write_control(tmp_path / "in")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty and not a previous build"):
        build_debian(tmp_path / "out", [tr], [pk])


def test_apt_style_names_and_missing_lists_error(tmp_path, capsys):
    lists = tmp_path / "lists"
    tr, pk = write_control(lists)
    tr.rename(lists / "deb.debian.org_debian_dists_bookworm_main_i18n_Translation-en")
    pk.rename(lists / "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages")
    (lists / "deb.debian.org_debian_dists_bookworm_InRelease").write_text("x")
    found_tr, found_pk = find_index_files(lists)
    assert [p.name for p in found_tr] == ["deb.debian.org_debian_dists_bookworm_main_i18n_Translation-en"]
    assert [p.name for p in found_pk] == ["deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages"]
    assert cli_main(["debian", "--out", str(tmp_path / "o"), "--lists", str(lists)]) == 0
    # every component's translations, as for Packages (Ubuntu images: main, universe, ...)
    ubuntu = lists / "archive.ubuntu.com_ubuntu_dists_jammy_universe_i18n_Translation-en.gz"
    ubuntu.write_bytes(gzip.compress(b""))
    assert [p.name for p in find_index_files(lists)[0]] == [ubuntu.name, found_tr[0].name]
    ubuntu.unlink()
    # no translations (container images disable them): the error says what to run
    (lists / "deb.debian.org_debian_dists_bookworm_main_i18n_Translation-en").unlink()
    with pytest.raises(DataError, match=re.escape("apt-get update -o Acquire::Languages=en")):
        find_index_files(lists)
    with pytest.raises(SystemExit) as stop:
        cli_main(["debian", "--out", str(tmp_path / "o2"), "--lists", str(tmp_path / "empty")])
    assert stop.value.code == 2
    err = " ".join(capsys.readouterr().err.split())  # (the message is wrapped at spaces)
    assert "apt-get update -o Acquire::Languages=en" in err and "--translation FILE --packages FILE" in err


def test_a_corrupt_lz4_frame_is_a_located_error(tmp_path):
    f = tmp_path / "Packages.lz4"
    f.write_bytes(b"\x04\x22\x4d\x18" + b"\0" * 16)
    with pytest.raises(DataError, match=re.escape(str(f))):
        read_index_text(f)  # not a crash


def test_lz4_reading(tmp_path):
    import lz4.frame as lz4frame

    tr, _ = write_control(tmp_path / "in")
    (tmp_path / "t.lz4").write_bytes(lz4frame.compress(tr.read_bytes()))
    assert read_index_text(tmp_path / "t.lz4") == tr.read_text()


def test_bad_control_line_is_located(tmp_path):
    tr, pk = write_control(tmp_path / "in")
    pk.write_text(pk.read_text().replace("Version: 1.0\n", "this is not a field\n", 1))
    with pytest.raises(DataError, match=re.escape(f"{pk}:3: expected 'Field: value'")):
        build_debian(tmp_path / "out", [tr], [pk])


def test_ensure_debian_dataset_caches(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DEBIAN_DIR, raising=False)
    write_control(tmp_path / "in")
    cfg = DataConfig(debian_dir=str(tmp_path / "in"), cache_dir=str(tmp_path / "cache"))
    out = ensure_debian_dataset(cfg, verbose=False)
    assert (out / "manifest.json").is_file() and out.parent == tmp_path / "cache"
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    assert ensure_debian_dataset(cfg, verbose=False) == out
    assert (out / "train.jsonl").stat().st_mtime_ns == stamp  # not rebuilt
    # no temporary folder left; the build is recorded as the cache's default set
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([out.name, RECORD_FILE])
    # the environment variable is used when the config does not say
    monkeypatch.setenv(ENV_DEBIAN_DIR, str(tmp_path / "in"))
    assert ensure_debian_dataset(DataConfig(cache_dir=str(tmp_path / "cache")), verbose=False) == out
    # new inputs: a new build
    (tmp_path / "in" / "Packages").write_text((tmp_path / "in" / "Packages").read_text().replace("src04", "src44"))
    assert ensure_debian_dataset(cfg, verbose=False) != out


def test_a_cached_set_cut_short_is_built_again_or_refused(tmp_path, monkeypatch, capsys):
    """A cached train.jsonl cut short (its manifest's sha256 differs): built again from the apt lists
    in one line; refused in one message when they are not at hand (the recorded set, no lists)."""
    from moco_retrieval.data.builders.debian import apt_lists

    monkeypatch.delenv(ENV_DEBIAN_DIR, raising=False)
    monkeypatch.setattr(apt_lists, "DEFAULT_LISTS_DIR", str(tmp_path / "no-apt-lists"))
    write_control(tmp_path / "in")
    cfg = DataConfig(debian_dir=str(tmp_path / "in"), cache_dir=str(tmp_path / "cache"))
    out = ensure_debian_dataset(cfg, verbose=False)
    whole = (out / "train.jsonl").read_text()

    def cut() -> None:
        (out / "train.jsonl").write_text("".join(whole.splitlines(keepends=True)[:10]))

    cut()
    capsys.readouterr()
    assert ensure_debian_dataset(cfg, verbose=False) == out
    assert capsys.readouterr().err == (
        f"[moco_retrieval] {out}: the cached Debian data set cannot be trusted: train.jsonl differs from its sha256 in "
        f"manifest.json (changed on disk); building it again from data.debian_dir={tmp_path / 'in'}\n")
    assert (out / "train.jsonl").read_text() == whole
    cut()
    with pytest.raises(DataError) as refused:
        ensure_debian_dataset(DataConfig(cache_dir=str(tmp_path / "cache")), verbose=False)
    assert str(refused.value).startswith(
        f"{out}: the cached Debian data set cannot be trusted: train.jsonl differs from its sha256 in manifest.json "
        "(changed on disk); and it cannot be built again: cannot build the Debian data set")


def test_a_read_only_cache_serves_its_set_and_refuses_a_build_in_one_message(tmp_path, monkeypatch):
    """A shared cache this process cannot write: the set it holds is used (the record of the default
    set left as it is); a set it would have to build is one message naming the cache."""
    import os

    monkeypatch.delenv(ENV_DEBIAN_DIR, raising=False)
    write_control(tmp_path / "in")
    write_control(tmp_path / "in2", reverse=True)
    (tmp_path / "in2" / "Packages").write_text((tmp_path / "in2" / "Packages").read_text().replace("src04", "src44"))
    cache = tmp_path / "cache"
    out = ensure_debian_dataset(DataConfig(debian_dir=str(tmp_path / "in"), cache_dir=str(cache)), verbose=False)
    (cache / RECORD_FILE).write_text("{}")  # another default recorded: finding this set would rewrite it
    deny(monkeypatch, cache)
    try:
        assert ensure_debian_dataset(DataConfig(debian_dir=str(tmp_path / "in"), cache_dir=str(cache)),
                                     verbose=False) == out
        with pytest.raises(DataError) as refused:
            ensure_debian_dataset(DataConfig(debian_dir=str(tmp_path / "in2"), cache_dir=str(cache)), verbose=False)
    finally:
        os.chmod(cache, 0o755)
    assert re.fullmatch(
        rf"cannot build the Debian data set from data.debian_dir={re.escape(str(tmp_path / 'in2'))} into "
        rf"{re.escape(str(cache))}: the cache is not writable \(Permission denied: {re.escape(str(cache))}/\S+\); give "
        r"the cache another folder \(data.cache_dir=DIR or \$MOCO_RETRIEVAL_CACHE=DIR\), or ask its owner to make it "
        r"writable", str(refused.value)), str(refused.value)


def test_the_built_set_is_found_without_pointing_at_the_apt_lists_again(tmp_path, monkeypatch):
    """Train once with the apt lists pointed at; evaluate, search and mine then find the same set."""
    from moco_retrieval.data.builders.debian import apt_lists

    monkeypatch.delenv(ENV_DEBIAN_DIR, raising=False)
    monkeypatch.setattr(apt_lists, "DEFAULT_LISTS_DIR", str(tmp_path / "no-apt-lists"))
    cache = str(tmp_path / "cache")
    with pytest.raises(DataError, match="cannot build the Debian data set"):  # nothing built, nothing pointed at
        ensure_debian_dataset(DataConfig(cache_dir=cache), verbose=False)
    write_control(tmp_path / "in")
    monkeypatch.setenv(ENV_DEBIAN_DIR, str(tmp_path / "in"))
    out = ensure_debian_dataset(DataConfig(cache_dir=cache), verbose=False)
    monkeypatch.delenv(ENV_DEBIAN_DIR)
    assert ensure_debian_dataset(DataConfig(cache_dir=cache), verbose=False) == out
    # another builder option is another set: not silently replaced by the recorded one
    with pytest.raises(DataError, match="cannot build the Debian data set"):
        ensure_debian_dataset(DataConfig(cache_dir=cache), eval_fraction=0.5, verbose=False)
    # an explicit setting still wins, and becomes the default
    write_control(tmp_path / "in2", reverse=True)
    (tmp_path / "in2" / "Packages").write_text((tmp_path / "in2" / "Packages").read_text().replace("src04", "src44"))
    other = ensure_debian_dataset(DataConfig(cache_dir=cache, debian_dir=str(tmp_path / "in2")), verbose=False)
    assert other != out
    assert ensure_debian_dataset(DataConfig(cache_dir=cache), verbose=False) == other
    # a recorded set that was deleted is not used
    import shutil

    shutil.rmtree(other)
    with pytest.raises(DataError, match="cannot build the Debian data set"):
        ensure_debian_dataset(DataConfig(cache_dir=cache), verbose=False)


def test_kind_debian(tmp_path, monkeypatch):
    """data=debian in the data module: prepare_data builds the set into the cache, setup reads it."""
    from moco_retrieval.data.datamodule import RetrievalDataModule

    monkeypatch.delenv("MOCO_RETRIEVAL_DEBIAN_DIR", raising=False)
    write_control(tmp_path / "apt")
    cfg = DataConfig(kind="debian", debian_dir=str(tmp_path / "apt"), cache_dir=str(tmp_path / "cache"), batch_size=2)
    dm = RetrievalDataModule(cfg)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.data_dir.parent == tmp_path / "cache"
    assert len(dm.train_pairs) + len(dm.eval_set.queries) == 33
    assert all(p.group != -1 for p in dm.train_pairs)


def test_ensure_debian_dataset_error_lists_locations(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DEBIAN_DIR, str(tmp_path / "nothing-here"))
    with pytest.raises(DataError) as ei:
        ensure_debian_dataset(DataConfig(cache_dir=str(tmp_path / "c")), verbose=False)
    msg = str(ei.value)
    assert "data.debian_dir (not set)" in msg and f"${ENV_DEBIAN_DIR}={tmp_path / 'nothing-here'}" in msg
    assert "/var/lib/apt/lists" in msg and "apt-get update -o Acquire::Languages=en" in msg


@pytest.mark.skipif(not SHARED_DEBIAN.is_dir(), reason="shared Debian snapshot absent")
def test_real_snapshot(tmp_path):
    m = build_debian(tmp_path / "deb", [SHARED_DEBIAN / "Translation-en.xz"], [SHARED_DEBIAN / "Packages.xz"])
    c = m["counts"]
    assert c["translation_records"] == 63956 and c["packages_stanzas"] == 63440
    assert 35_000 <= c["pairs"] <= 45_000
    assert c["eval_documents"] >= 2400
    train = read_pairs_jsonl(tmp_path / "deb" / "train.jsonl")
    ev = read_beir(tmp_path / "deb" / "eval", "test")
    assert len(ev.corpus) == c["eval_documents"] >= 2400
    train_groups = {p.group for p in train}
    assert not train_groups & set(ev.doc_groups.values())  # no source on both sides
    assert len({p.doc_id for p in train} | {stable_id(d) for d in ev.corpus}) == c["pairs"]
    assert len({p.query.casefold() for p in train}) == len(train)


def test_cli_reads_the_env_lists_and_its_error_names_lists(tmp_path, monkeypatch, capsys):
    """`python -m moco_retrieval.data debian --out DIR` as docs/guide/data.md writes it: the apt lists of
    $MOCO_RETRIEVAL_DEBIAN_DIR, as training reads them; a folder without them names --lists."""
    lists = tmp_path / "lists"
    write_control(lists)
    monkeypatch.setenv("MOCO_RETRIEVAL_DEBIAN_DIR", str(lists))
    assert cli_main(["debian", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "train.jsonl").is_file()
    capsys.readouterr()
    monkeypatch.setenv("MOCO_RETRIEVAL_DEBIAN_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as stop:
        cli_main(["debian", "--out", str(tmp_path / "o2")])
    assert stop.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--lists DIR" in err and "MOCO_RETRIEVAL_DEBIAN_DIR" in err and "nowhere" in err
