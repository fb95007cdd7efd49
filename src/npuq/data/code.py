"""Corpus ``code``: Python source, a third kind of text beside documentation and prose.

The text is the Python standard library's own source files, read from the running
interpreter's installation (``sysconfig.get_paths()["stdlib"]``): present on every machine with
a full Python, no download, under the PSF license like the builtin corpus's documentation.

Only the modules of :data:`MODULES` are read: a fixed list of pure-Python modules, so no test
folder, ``idlelib``, ``site-packages`` or platform-specific file ever enters, and the set of
documents does not depend on what else a machine has installed. The list holds modules that
exist under the same path from Python 3.9 to 3.13 (none of those that became packages or shims,
such as ``pathlib`` or ``datetime``, and none of the protocol parsers that security releases
patch most often). Each file is one document, its id ``code/`` plus the path under the
standard library (``code/json/decoder.py``); the ``calib`` and ``eval`` halves are chosen by a
SHA-256 of that path (as the builtin corpus does with topic names), so they are disjoint and the
same on every machine.

The words are those of the interpreter that runs: patch releases of one Python version rarely
touch these files, other versions change some of them, so figures measured on this corpus
name the Python version they used.
"""

from __future__ import annotations

import sysconfig
import warnings
from pathlib import Path

from npuq.data.document import Document, decode_utf8, hash_split
from npuq.errors import NpuqError

MODULES = (
    "abc.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "code.py", "codeop.py", "colorsys.py",
    "concurrent/futures/_base.py", "concurrent/futures/thread.py", "contextlib.py", "copy.py", "csv.py",
    "dataclasses.py", "filecmp.py", "fnmatch.py", "fractions.py", "functools.py", "getopt.py", "gettext.py",
    "glob.py", "graphlib.py", "heapq.py", "hmac.py", "html/__init__.py", "json/__init__.py", "json/decoder.py",
    "json/encoder.py", "json/scanner.py", "json/tool.py", "linecache.py", "mimetypes.py", "numbers.py",
    "operator.py", "pprint.py", "queue.py", "quopri.py", "random.py", "reprlib.py", "sched.py", "secrets.py",
    "selectors.py", "shlex.py", "statistics.py", "tabnanny.py", "tempfile.py", "textwrap.py", "timeit.py",
    "traceback.py", "types.py", "uuid.py", "wave.py", "weakref.py", "zipapp.py",
)


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_documents(split: str, root: Path | None = None) -> list[Document]:
    """The modules of ``split`` found under ``root`` (the running Python's standard library),
    sorted by id. A module the installation lacks is left out with a warning; none at all is an
    NpuqError (a Python shipped without its .py sources, such as an embedded one)."""
    root = stdlib_folder() if root is None else root
    docs, missing = [], []
    for path in sorted(MODULES):
        try:
            data = (root / path).read_bytes()
        except OSError:
            missing.append(path)
            continue
        if hash_split(path) == split:
            text, replaced = decode_utf8(data)
            if text.strip():
                docs.append(Document(f"code/{path}", text, replaced=replaced))
    if len(missing) == len(MODULES):
        raise NpuqError(f"corpus code: this Python has no standard library source files under {root} (none of its "
                        f"{len(MODULES)} modules, such as {MODULES[0]}); install Python with its full standard "
                        "library, or use another corpus (e.g. builtin)")
    if missing:
        warnings.warn(f"corpus code: {len(missing)} of its {len(MODULES)} modules are not under {root} and are left "
                      f"out ({', '.join(missing)}): figures on this corpus will differ from another machine's",
                      stacklevel=3)
    return docs
