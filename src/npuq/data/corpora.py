"""Text corpora: documents with a stable id, each a page of text.

A corpus is named by a spec string:

- ``builtin``: the English documentation shipped with CPython (``pydoc_data.topics``), present
  on every machine without downloads. Topics are split into disjoint ``calib`` and ``eval``
  halves by a SHA-256 of the topic name, so the split is the same on every machine and
  calibration text never appears in evaluation.
- ``file:PATH``: a ``.txt`` file (one document) or a ``.jsonl`` file (``{"text": ...}`` per
  line). A file is one set of documents: ``split`` does not apply; pass a different file for
  calibration and evaluation.
- ``wikitext2``: WikiText-2 (raw) one document per Wikipedia article, as lm-evaluation-harness's
  ``wikitext`` task reads it (``EleutherAI/wikitext_document_level``), through the optional
  ``datasets`` library; ``eval`` is the test split, ``calib`` the train split.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from npuq.errors import NpuqError

SPLITS = ("eval", "calib")
CORPUS_HELP = "builtin, file:PATH (.txt or .jsonl with a 'text' field per line) or wikitext2"


@dataclass(frozen=True)
class Document:
    id: str
    page: str  # the original text: words and bytes are counted on it
    text: str | None = None  # what the model scores, where it differs from page (detokenized wikitext)

    @property
    def target(self) -> str:
        return self.page if self.text is None else self.text


def load_corpus(spec: str, split: str = "eval") -> list[Document]:
    """The documents of corpus ``spec`` (see the module docstring), sorted by id; never empty."""
    if split not in SPLITS:
        raise NpuqError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if spec == "builtin":
        docs = builtin_documents(split)
    elif spec.startswith("file:"):
        docs = file_documents(spec[len("file:"):])
    elif spec == "wikitext2":
        docs = wikitext2_documents(split)
    else:
        raise NpuqError(f"unknown corpus {spec!r}; use {CORPUS_HELP}")
    if not docs:
        raise NpuqError(f"corpus {spec!r} (split {split}) has no documents with text: give a corpus with some text")
    return docs


# --------------------------------------------------------------------------- builtin
def builtin_split_of(topic: str) -> str:
    """"calib" or "eval": the first byte of SHA-256(topic) decides (Python's hash() is salted)."""
    return "calib" if hashlib.sha256(topic.encode("utf-8")).digest()[0] % 2 == 0 else "eval"


def builtin_documents(split: str) -> list[Document]:
    from pydoc_data.topics import topics  # {topic: text}, part of the standard library

    return sorted(
        (Document(f"builtin/{name}", text) for name, text in topics.items()
         if builtin_split_of(name) == split and text.strip()),
        key=lambda d: d.id,
    )


# --------------------------------------------------------------------------- file:PATH
def file_documents(path_text: str) -> list[Document]:
    path = Path(path_text).expanduser()
    if not path_text:
        raise NpuqError("corpus 'file:' names no file: use file:PATH with a .txt or .jsonl file")
    if not path.is_file():
        raise NpuqError(f"corpus file {path} does not exist: check the path after 'file:'")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise NpuqError(f"corpus file {path}: expected a .txt or .jsonl file, got {suffix or 'no suffix'!r}")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise NpuqError(f"corpus file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): convert it to UTF-8") from None
    if suffix == ".txt":
        return [Document(path.name, content)] if content.strip() else []
    docs = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"corpus file {path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise NpuqError(f"{where}: not valid JSON ({exc.msg}): write one JSON object per line") from None
        if not isinstance(record, dict) or "text" not in record:
            raise NpuqError(f'{where}: no "text" field: write each line as {{"text": "..."}}')
        if not isinstance(record["text"], str):
            raise NpuqError(f'{where}: "text" is {type(record["text"]).__name__}, expected a string')
        if record["text"].strip():
            docs.append(Document(f"{path.name}:{number:06d}", record["text"]))
    return docs


# --------------------------------------------------------------------------- wikitext2
WIKITEXT_DATASET = ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1")
WIKITEXT_SPLITS = {"eval": "test", "calib": "train"}


def wikitext2_documents(split: str) -> list[Document]:
    try:
        import datasets
    except ImportError:
        raise NpuqError(
            "corpus wikitext2 needs the 'datasets' library (pip install datasets) and the data in its cache "
            "or a network; offline, save the articles as JSON lines ({\"text\": ...}) and use --corpus file:PATH"
        ) from None
    hf_split = WIKITEXT_SPLITS[split]
    try:
        rows = datasets.load_dataset(*WIKITEXT_DATASET, split=hf_split)
    except Exception as exc:  # datasets raises many types when offline or the cache is missing
        raise NpuqError(
            f"cannot load {WIKITEXT_DATASET[0]} ({WIKITEXT_DATASET[1]}, {hf_split}): {exc}; "
            "connect once to cache it, or save the articles as JSON lines and use --corpus file:PATH"
        ) from None
    return [
        Document(f"wikitext2/{hf_split}/{i:04d}", row["page"], wikitext_detokenize(row["page"]))
        for i, row in enumerate(rows) if row["page"].strip()
    ]


# WikiText stores text tokenized with spaces ("in 1 @,@ 000 years ."); lm-evaluation-harness
# scores the page after undoing that (the Megatron-LM detokenizer), in this order.
_WIKITEXT_RULES: tuple[tuple[str, str, bool], ...] = (  # (pattern, replacement, is_regex)
    ("s '", "s'", False),
    (r"/' [0-9]/", r"/'[0-9]/", True),
    (" @-@ ", "-", False),
    (" @,@ ", ",", False),
    (" @.@ ", ".", False),
    (" : ", ": ", False),
    (" ; ", "; ", False),
    (" . ", ". ", False),
    (" ! ", "! ", False),
    (" ? ", "? ", False),
    (" , ", ", ", False),
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)", True),
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]", True),
    (r"{\s*([^}]*?)\s*}", r"{\1}", True),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"', True),
    (r"'\s*([^']*?)\s*'", r"'\1'", True),
    ("= = = =", "====", False),
    ("= = =", "===", False),
    ("= =", "==", False),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}", False),
    (" \n", "\n", False),
    ("\n ", "\n", False),
    (" N ", " 1 ", False),
    (" 's", "'s", False),
)


def wikitext_detokenize(text: str) -> str:
    for pattern, replacement, is_regex in _WIKITEXT_RULES:
        text = re.sub(pattern, replacement, text) if is_regex else text.replace(pattern, replacement)
    return text
