"""Converted GGUF files in the user cache, so that only the first load of a GGUF converts it.

Converting a GGUF (parsing its metadata into a transformers config and tokenizer, dequantizing
every tensor) takes many seconds; what it produces is an ordinary Hugging Face folder, saved once
as ``<cache>/gguf/<sha256 of the GGUF's bytes>/``:

    config.json, tokenizer files   what transformers made of the GGUF metadata
    model.safetensors              float32 tensors under npuq's names (q/k rows already un-permuted)
    npuq-tokenizer.json            the `tokenizers` pipeline inside that tokenizer, as transformers
                                   loads it back, when it alone encodes and decodes the same
                                   (:class:`CachedEncoder`)
    npuq-cache.json                written last: the versions that made the entry, npuq's
                                   ModelConfig, the size of every file and the sha256 of
                                   every file but the weights

The entry is keyed by the file's content, never its name: an edited or replaced GGUF gets a new
entry. Hashing a large GGUF costs seconds, so ``<cache>/gguf/index.json`` remembers the hash of
each file by (resolved path, size, mtime_ns, ctime_ns, inode); any change to one of them hashes
the file again. A load from the cache reads neither the GGUF nor transformers (the config comes
from the manifest, the transformers config and tokenizer load when first used; calibration and
perplexity text is encoded without them, by :class:`CachedEncoder`) and takes the
memory-mapped float32 tensors as the model's parameters, after the same name, shape and
finiteness checks as any checkpoint.

An entry is written with :func:`npuq.fsio.atomic_dir` (an interrupted conversion leaves
nothing); one that is incomplete, damaged or fails the loader's checks is removed and rebuilt
from the GGUF with a one-line warning. Entries made by other versions of transformers, gguf or
npuq's conversion code (a hash of the modules that convert) are rebuilt quietly.
``NPUQ_NO_MODEL_CACHE=1`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from npuq import __version__
from npuq.errors import ModelLoadError, NpuqError
from npuq.fsio import atomic_dir, file_sha256, read_json, remove_stale, resolve_inside, user_cache_dir, write_json
from npuq.models.config import ModelConfig
from npuq.models.weights import write_safetensors

CACHE_FORMAT = 1
MANIFEST = "npuq-cache.json"
FAST_TOKENIZER = "npuq-tokenizer.json"
WEIGHTS = "model.safetensors"
INDEX = "index.json"
INDEX_LIMIT = 256  # files remembered; the oldest are forgotten first (forgetting costs one re-hash)
DISABLE_VARIABLE = "NPUQ_NO_MODEL_CACHE"
_FREE_MARGIN = 1 << 30  # never fill the disk to the last GiB with a cache entry
_ABANDONED_AFTER_S = 6 * 3600  # a temporary folder this old is left from a killed conversion

log = logging.getLogger("npuq.models")


def cache_enabled() -> bool:
    """False when $NPUQ_NO_MODEL_CACHE is set to anything but "", "0", "false" or "no"."""
    return os.environ.get(DISABLE_VARIABLE, "").strip().lower() in ("", "0", "false", "no")


def cache_root() -> Path:
    return user_cache_dir() / "gguf"


def _signature(path: Path) -> dict[str, int]:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "device": st.st_dev}


# What a conversion depends on besides the GGUF's bytes: these modules, and the packages below.
_CONVERSION_CODE = ("sources.py", "config.py", "gguf_cache.py")


def _code_digest() -> str:
    digest = hashlib.sha256()
    for name in _CONVERSION_CODE:
        try:
            digest.update((Path(__file__).parent / name).read_bytes())
        except OSError:
            digest.update(b"?")
    return digest.hexdigest()[:16]


def _versions() -> dict[str, Any]:
    found: dict[str, Any] = {"format": CACHE_FORMAT, "npuq": __version__, "code": _code_digest()}
    for package in ("transformers", "gguf", "safetensors"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- the hash index
def _read_index(root: Path) -> dict[str, dict[str, Any]]:
    path = root / INDEX
    if not path.is_file():
        return {}
    try:
        raw = read_json(path, "GGUF cache index", "it is rebuilt")
    except NpuqError:
        return {}  # a damaged index only costs a re-hash; the next load writes a good one
    files = raw.get("files") if isinstance(raw, dict) and raw.get("format") == CACHE_FORMAT else None
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, dict)}


def _write_index(root: Path, files: dict[str, dict[str, Any]]) -> None:
    if len(files) > INDEX_LIMIT:
        files = dict(list(files.items())[-INDEX_LIMIT:])
    write_json(root / INDEX, {"format": CACHE_FORMAT, "files": files})


# --------------------------------------------------------------------------- one entry
@dataclass
class Entry:
    """The cache entry of one GGUF file, as of the moment it was hashed."""

    gguf: Path  # resolved
    sha256: str
    signature: dict[str, int]  # the file's stat when hashed
    indexed: bool  # index.json already maps this signature to this hash
    manifest: dict[str, Any] | None = None  # set by a successful check()

    @property
    def folder(self) -> Path:
        return cache_root() / self.sha256

    @property
    def weights(self) -> Path:
        return self.folder / WEIGHTS

    def check(self) -> tuple[str, bool] | None:
        """Why the entry cannot be loaded, and whether that deserves a warning; None when it looks
        complete. Checks the manifest, versions and every file's size (and hash, weights aside):
        cheap, no tensor is read. The loader's own checks come after."""
        folder = self.folder
        if not folder.is_dir():
            return "absent", False
        try:
            manifest = read_json(folder / MANIFEST, "GGUF cache entry", "it is rebuilt")
        except NpuqError as exc:
            return _one_line(exc), True
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            return f"{MANIFEST} is not a manifest", True
        if manifest.get("versions") != _versions():
            return f"made by other versions ({manifest.get('versions')})", False
        if manifest.get("gguf_sha256") != self.sha256:
            return f"{MANIFEST} names another GGUF", True
        files = manifest["files"]
        for required in ("config.json", WEIGHTS):
            if required not in files:
                return f"{MANIFEST} lists no {required}", True
        for name, facts in files.items():
            try:
                path = resolve_inside(folder, name, "GGUF cache entry")
            except NpuqError as exc:
                return _one_line(exc), True
            if not isinstance(facts, dict) or not path.is_file():
                return f"{name} is missing", True
            size = path.stat().st_size
            if size != facts.get("size"):
                return f"{name} has {size} bytes, {facts.get('size')} when written", True
            if facts.get("sha256") is not None and file_sha256(path) != facts["sha256"]:
                return f"{name} changed since it was written", True
        self.manifest = manifest
        return None

    def model_config(self) -> Any:
        """npuq's ModelConfig as stored (checked like any config read back); after check()."""
        if not isinstance(self.manifest, dict) or not isinstance(self.manifest.get("model_config"), dict):
            raise ModelLoadError(f"{self.folder / MANIFEST}: no model_config")
        return ModelConfig.from_dict(self.manifest["model_config"])

    def encoder(self) -> CachedEncoder | None:
        """The light stand-in for the entry's tokenizer; None when the conversion found none
        that encodes as the transformers tokenizer does. After check()."""
        facts = (self.manifest or {}).get("fast_tokenizer")
        return CachedEncoder(self.folder / FAST_TOKENIZER, facts) if facts is not None else None

    def discard(self, reason: str, warn: bool = True) -> None:
        """Remove the entry (it is rebuilt by the load that follows)."""
        if warn:
            log.warning("npuq: warning: the cached conversion of %s in %s is unusable (%s); rebuilding it from the GGUF",
                        self.gguf, self.folder, _one_line(reason))
        shutil.rmtree(self.folder, ignore_errors=True)

    def remember(self) -> None:
        """Record this file's hash in the index (no-op when it already is); never fails a load."""
        if self.indexed:
            return
        root = cache_root()
        try:
            files = _read_index(root)
            previous = files.pop(str(self.gguf), {}).get("sha256")
            files[str(self.gguf)] = {**self.signature, "sha256": self.sha256}
            _write_index(root, files)
        except OSError as exc:
            log.debug("cannot write the GGUF cache index in %s: %s", root, exc)
            return
        self.indexed = True
        # The file at this path changed: its old entry goes unless another indexed file has that content.
        if (_is_sha256(previous) and previous != self.sha256
                and all(v.get("sha256") != previous for v in files.values())):
            shutil.rmtree(root / previous, ignore_errors=True)

    def store(self, hf_config: Any, tokenizer: Any, tensors: Any, model_config: Any) -> bool:
        """Write the conversion of this GGUF as its entry, atomically; False (and one warning)
        when it cannot be written. ``tensors`` (``shapes()``, ``get(name)`` → float32: the lazy
        :class:`npuq.models.sources.GGUFTensors`) are decoded and written one at a time, each
        checked for finite values first. A GGUF that changed while it was being read is not
        stored."""
        try:
            if _signature(self.gguf) != self.signature:
                log.debug("%s changed while it was loaded: not caching it", self.gguf)
                return False
            needed = sum(math.prod(shape) for shape in tensors.shapes().values()) * 4 + (64 << 20)
            root = cache_root()
            root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(root).free
            if free < needed + _FREE_MARGIN:
                log.warning("npuq: warning: not caching the conversion of %s: it needs %.1f GiB and %s has %.1f GiB free",
                            self.gguf, needed / 2**30, root, free / 2**30)
                return False
            # atomic_dir's folders of killed conversions: never read, but a large model's hold gigabytes
            remove_stale((p for p in root.glob(".*") if p.is_dir() and p.suffix in (".tmp", ".old")), _ABANDONED_AFTER_S)
            with atomic_dir(self.folder) as tmp:
                hf_config.save_pretrained(tmp)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                fast_tokenizer = _write_fast_tokenizer(tmp) if tokenizer is not None else None
                write_safetensors(tmp / WEIGHTS, tensors.shapes(), tensors.get)
                files = {}
                for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                    name = path.relative_to(tmp).as_posix()
                    files[name] = {"size": path.stat().st_size, "sha256": None if name == WEIGHTS else file_sha256(path)}
                write_json(tmp / MANIFEST, {"gguf": str(self.gguf), "gguf_sha256": self.sha256, "versions": _versions(),
                                            "model_config": model_config.to_dict(), "fast_tokenizer": fast_tokenizer,
                                            "files": files})
        except ModelLoadError:  # a tensor of the GGUF itself is bad: no cache problem, the load fails
            raise
        except Exception as exc:  # a full disk, a read-only cache, a config transformers cannot save
            log.warning("npuq: warning: cannot cache the conversion of %s in %s (%s); the next load converts it again",
                        self.gguf, self.folder, _one_line(f"{type(exc).__name__}: {exc}"))
            return False
        self.remember()
        return True


def entry_for(path: str | os.PathLike) -> Entry | None:
    """The cache entry for the GGUF at ``path`` (hashing the file unless the index knows it); None
    when the cache is off or the file cannot be read (the loader then reports the problem)."""
    if not cache_enabled():
        return None
    try:
        gguf = Path(path).resolve()
        signature = _signature(gguf)
    except OSError:
        return None
    known = _read_index(cache_root()).get(str(gguf))
    if known is not None:
        sha = known.get("sha256")
        if _is_sha256(sha) and {k: known.get(k) for k in signature} == signature:
            return Entry(gguf, sha, signature, indexed=True)
    try:
        sha = file_sha256(gguf)
    except OSError:
        return None
    return Entry(gguf, sha, signature, indexed=False)


# Text whose encoding and decoding the light tokenizer must reproduce exactly, beyond having the
# same pipeline: spaces and punctuation a decode might "clean up", tabs and blank lines, digits,
# accents written precomposed and decomposed, other scripts, an emoji and special-token strings.
_PROBE = ("Hello , world . it 's  two  spaces ; don 't ?\n\n\tTab 12345 3.14159 ünïcödé u\u0308 café cafe\u0301 "
          "日本語のテキスト Привет 🙂 <s> </s> <|endoftext|> <|im_start|> <bos> <eos>  end \n")


def _write_fast_tokenizer(folder: Path) -> dict[str, Any] | None:
    """Write FAST_TOKENIZER into ``folder`` and return the facts CachedEncoder needs, when the
    tokenizer saved there, as transformers loads it back, is its `tokenizers` pipeline and
    nothing more for encoding without special tokens and decoding: the same serialized pipeline,
    no splitting of special tokens, no clean-up of decoded spaces, and the same ids and text on
    a probe. None (nothing written) otherwise, or on any failure: the tokenizer then always
    comes from transformers, as before."""
    try:
        # transformers (0.7 s) loads on use: a cached GGUF model runs without it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or tokenizer.split_special_tokens or tokenizer.clean_up_tokenization_spaces:
            return None
        pipeline = backend.to_str()
        fast = Tokenizer.from_str(pipeline)
        ids = tokenizer.encode(_PROBE, add_special_tokens=False)
        if (fast.to_str() != pipeline or fast.encode(_PROBE, add_special_tokens=False).ids != ids
                or fast.decode(ids, skip_special_tokens=False) != tokenizer.decode(ids)):
            return None
        (folder / FAST_TOKENIZER).write_text(pipeline, encoding="utf-8")
        return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "size": len(tokenizer)}
    except Exception as exc:  # the transformers tokenizer still serves
        log.debug("no light tokenizer for %s: %s: %s", folder, type(exc).__name__, exc)
        return None


class CachedEncoder:
    """Stands in for the transformers tokenizer of a cached conversion where npuq only encodes
    text (calibration tokens, perplexity): ``encode`` without special tokens, ``decode``, the
    BOS/EOS ids and ``len``. It runs the `tokenizers` pipeline that tokenizer wraps, serialized
    and checked against it when the entry was written, so the ids are the same, and it loads in
    0.2 s where the transformers tokenizer takes 1.9 s (1.4 s of it importing transformers)."""

    def __init__(self, path: Path, facts: Any) -> None:
        ids = ("bos_token_id", "eos_token_id")
        if (not isinstance(facts, dict) or not all(facts.get(k) is None or type(facts.get(k)) is int for k in ids)
                or type(facts.get("size")) is not int):
            raise ModelLoadError(f"{path.parent / MANIFEST}: malformed fast_tokenizer entry {facts!r}")
        try:
            self._pipeline = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
        self.bos_token_id: int | None = facts["bos_token_id"]
        self.eos_token_id: int | None = facts["eos_token_id"]
        self._size: int = facts["size"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens:
            raise ValueError("CachedEncoder encodes without special tokens only; use the model's tokenizer")
        return self._pipeline.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Any) -> str:
        return self._pipeline.decode(list(ids), skip_special_tokens=False)

    def __len__(self) -> int:
        return self._size


class CachedHFConfig:
    """Stands in for the transformers config of a cached conversion: loads it from the entry's
    config.json when an attribute is first read, so a load that never needs it never imports
    transformers (about 2 s)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._config: Any = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_folder", "_config"):
            raise AttributeError(name)
        if self._config is None:
            # transformers (0.7 s) loads on use: a cached GGUF model runs without it
            from transformers import AutoConfig

            try:
                self._config = AutoConfig.from_pretrained(self._folder, local_files_only=True)
            except Exception as exc:
                raise ModelLoadError(f"{self._folder}: the cached config cannot be read ({type(exc).__name__}: "
                                     f"{exc}); remove the folder and load the model again") from None
        return getattr(self._config, name)

    def __repr__(self) -> str:
        return f"CachedHFConfig({str(self._folder)!r})"
