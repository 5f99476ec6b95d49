"""The built-in data set: Debian package descriptions as a title-to-body retrieval task.

Inputs are apt's index files (:mod:`.apt_lists` reads them and finds where they are) (what ``apt-get update`` stores under ``/var/lib/apt/lists``):
``Translation-en`` (``Package``, ``Description-md5``, ``Description-en``) and ``Packages``
(``Package``, ``Source``, ``Description-md5``, ...), plain or compressed (xz, gz, bz2, lz4; the
compression is detected from the file's magic bytes; lz4 needs ``pip install lz4``).

How the set is built (:func:`.build.build_debian`; steps 1-4: :mod:`.records`):

1. **Join.** A translation record joins a ``Packages`` stanza on (``Package``, ``Description-md5``)
   (the md5 is that of the full ``Description-en`` value plus a newline; a ``Packages`` stanza
   without ``Description-md5`` but with a full multi-line ``Description`` gets it computed).
   Translation records of packages absent from the ``Packages`` files (other architectures) are
   dropped: their source is unknown. When one package name joins more than once (several suites),
   the record with the smallest md5 is kept.
2. **Source (group).** ``Source`` without its optional ``(version)``; absent means the package name.
   When one (package, md5) appears with several sources, the smallest name is used.
3. **Texts.** query = the short description (first line of ``Description-en``); document = the long
   description: continuation lines with their leading space removed and trailing spaces stripped,
   lines of a paragraph joined by ``"\\n"``, paragraphs (separated by `` .`` lines) joined by
   ``"\\n\\n"``. Records with an empty long description are dropped.
4. **Duplicates.** Records are visited in package-name order and a record is kept only when
   neither its query nor its document key was already kept (so the alphabetically first package
   wins). Keys are compared after NFC, whitespace collapsing and case folding. With
   ``dedup="first-paragraph"`` (default) the document key is the first paragraph of the long
   description: binary packages of one source usually repeat it verbatim and add only a line
   such as "This package contains the data files", so those near-duplicates are dropped as
   well. ``dedup="exact"`` keys on the whole document and keeps more of them.
5. **Split.** A source goes to eval iff ``stable_id(source) % 1_000_000 < eval_fraction * 1_000_000``
   (``stable_id``: first 8 bytes of the sha256 of the name, see :mod:`.ids`), so every source is on
   exactly one side and the split of a source never changes when other packages come and go.

Outputs (:func:`.build.write_debian`): ``train.jsonl`` (``query``, ``positive``, ``query_id`` = ``doc_id`` =
package name, ``group`` = source name), ``eval/`` in the BEIR layout (``corpus.jsonl`` with
``_id`` = package name, ``title`` empty, ``text``, ``group`` = source name; ``queries.jsonl`` with
``_id`` = package name; ``qrels/test.tsv``: each query's one relevant document is its own
package's), and ``manifest.json`` (counts, the inputs' sha256, the rules). Every file is sorted by
package name and written without timestamps: the same inputs give byte-identical outputs.

Training builds the set on first use into the cache and finds it again later (:mod:`.cache`).
The package's names are importable from ``moco_retrieval.data.builders.debian``.
"""
from moco_retrieval.data.builders.debian.apt_lists import (
    APT_UPDATE_HINT,
    DEFAULT_LISTS_DIR,
    ENV_DEBIAN_DIR,
    find_index_files,
    parse_control,
    parse_description,
    read_index_text,
    resolve_debian_inputs,
    source_name,
)
from moco_retrieval.data.builders.debian.build import (
    BUILDER_VERSION,
    DEFAULT_EVAL_FRACTION,
    MIN_EVAL_DOCS,
    build_debian,
    is_eval_source,
    split_rule,
    write_debian,
)
from moco_retrieval.data.builders.debian.cache import RECORD_FILE, ensure_debian_dataset, record_build, recorded_build
from moco_retrieval.data.builders.debian.records import DEDUP_MODES, DebianPair, deduplicate, load_records

__all__ = [
    "APT_UPDATE_HINT",
    "BUILDER_VERSION",
    "DEDUP_MODES",
    "DEFAULT_EVAL_FRACTION",
    "DEFAULT_LISTS_DIR",
    "ENV_DEBIAN_DIR",
    "MIN_EVAL_DOCS",
    "RECORD_FILE",
    "DebianPair",
    "build_debian",
    "deduplicate",
    "ensure_debian_dataset",
    "find_index_files",
    "is_eval_source",
    "load_records",
    "parse_control",
    "parse_description",
    "read_index_text",
    "record_build",
    "recorded_build",
    "resolve_debian_inputs",
    "source_name",
    "split_rule",
    "write_debian",
]
