"""Which files a corpus is: data paths (files, directories, globs) resolved and checked, or the default corpus
(the running Python's standard library sources).

A data path must be a regular UTF-8 text file, or a directory or glob of them: anything else (nothing, a link
loop, a pipe, a device, a binary or sparse file) is refused naming what it is, before any of it is read whole.
"""
from __future__ import annotations

import errno
import glob
import os
import stat
import sysconfig
from pathlib import Path

from bunsan.training.stream import check_text_start


# Excluded from the default corpus: tests (huge, repetitive), vendored or bundled
# code, codec tables (encodings/*: generated hex maps) and generated data modules.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                  "__pycache__", "encodings", "pydoc_data", "turtledemo"}


def default_corpus_files() -> list[Path]:
    """The running Python's standard library ``.py`` sources, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):
        rel = Path(d).relative_to(root)
        # Prune while walking: site-packages alone can hold far more files than the stdlib.
        dirs[:] = [x for x in dirs if x not in _EXCLUDED_DIRS and not (rel == Path(".") and x.startswith("config-"))]
        files.extend(Path(d) / n for n in names if n.endswith(".py") and not n.startswith("_sysconfigdata"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}; "
                                "pass data paths explicitly")
    return files


def _dir_files(d: Path) -> list[Path]:
    # Hidden entries (.git, .venv) are skipped: their contents are not text corpus.
    out = []
    for root, dirs, names in os.walk(d):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__")
        out.extend(Path(root) / n for n in sorted(names) if not n.startswith("."))
    return out


def resolve_paths(paths: list[str] | str, text: bool = True) -> list[Path]:
    """Expand files, directories (recursive) and globs into a de-duplicated file list; `text`: each file's
    start must be UTF-8 text (a corpus; records files are checked by their reader)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for pat in map(str, paths):
        pat_x = os.path.expanduser(pat)
        if any(ch in pat_x for ch in "*?["):
            hits = sorted(Path(h) for h in glob.glob(pat_x, recursive=True))
            found = [f for h in hits for f in (_dir_files(h) if h.is_dir() else [h])]
        elif Path(pat_x).is_dir():
            found = _dir_files(Path(pat_x))
        elif Path(pat_x).is_file():
            found = [Path(pat_x)]
        else:
            raise not_a_data_path(pat, pat_x)
        if not found:
            raise FileNotFoundError(f"data path {pat!r} matched no files")
        out.extend(found)
    first = {}
    for f in out:  # de-duplicate by real path, keeping first-seen order
        try:
            mode = os.stat(f).st_mode
        except OSError:
            raise not_a_data_path(str(f), str(f)) from None
        if not stat.S_ISREG(mode):    # a pipe or device would block the read, or never end
            raise not_a_data_path(str(f), str(f))
        if text:                     # a binary or sparse file is refused before its digest reads it whole
            check_text_start(f)
        first.setdefault(f.resolve(), f)
    return list(first.values())


def not_a_data_path(given: str, path: str) -> Exception:
    """What is at `path` that is not a data file or directory: nothing, a broken or looping link, a pipe, a
    device or a socket (each would block a read, never end, or is not there)."""
    try:
        link = os.lstat(path)
    except OSError:
        return FileNotFoundError(f"data path {given!r} does not exist (working directory {os.getcwd()})")
    if stat.S_ISLNK(link.st_mode):
        try:
            os.stat(path)
        except OSError as e:
            what = "a loop of symbolic links" if e.errno == errno.ELOOP else "a symbolic link to nothing"
            return FileNotFoundError(f"data path {given!r} is {what} ({os.readlink(path)!r}); point at the file")
    kind = next((name for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character "
                 "device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
                 if test(os.stat(path).st_mode)), "not a regular file")
    return ValueError(f"data path {given!r} is {kind}, not a file: reading it would block or never end; give "
                      "regular text files or directories of them")
