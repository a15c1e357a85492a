"""An offline text corpus from the documentation installed on this machine (the default continued-pretraining
data of the LLM methods that train: RePo, L2A, Softplus attention).

``pydoc_data`` holds about 0.1M SmolLM2 tokens: too little for continued pretraining to move anything. The
builder collects, without importing anything:

* **docstrings** of every Python source file of the standard library and of the installed packages (parsed with
  :mod:`ast`): one document per module: its dotted name, the module docstring, then each class / function
  with its signature line and docstring, in source order;
* **documentation files** inside the installed packages (``*.md``, ``*.rst``, ``*.txt`` other than licences,
  requirement lists and package metadata) and each distribution's long description (``METADATA`` body);
* the standard library's ``pydoc_data`` topics.

Documents shorter than ``min_chars`` are dropped, longer than ``max_chars`` are cut at paragraph boundaries into
pieces; exact duplicates (after whitespace normalisation: vendored copies, re-exported docstrings) are removed,
and the result is written once, atomically, as ``docs.jsonl`` (``{"text", "source"}`` per line, sorted by
source; module documents count as duplicates when all but their name header match) plus ``manifest.json`` (the distributions and versions read, counts) under
``$LITCTX_CACHE_DIR/corpora/installed_docs-<fingerprint>``. The fingerprint hashes the Python version, the
installed distributions and versions and the builder's settings, so a changed environment builds a new corpus
and an unchanged one reuses it. ``TextDataModule`` splits it by document with its seed
(``data.args.corpus: installed_docs``).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from litctx_common.io import atomic_path, jsonl_lines
from litctx_common.paths import default_cache_dir

__all__ = ["CorpusSpec", "CORPORA", "build_installed_docs", "installed_docs_path", "module_document",
           "corpus_documents"]

BUILDER_VERSION = 1
_SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "idlelib", "turtledemo", "lib2to3", "site-packages",
              "dist-packages", "ensurepip", "_vendor", "vendor", "benchmarks", "examples"}
_SKIP_FILES = re.compile(r"(?i)^(licen[cs]e|copying|notice|authors|requirements.*|top_level|entry_points|record|"
                         r"installer|requested|wheel|direct_url|dependency_links|namespace_packages|zip-safe|"
                         r"sources|api_tests|.*\.dist-info)(\.(txt|md|rst))?$")


@dataclass(frozen=True)
class CorpusSpec:
    """Settings of the installed-documentation corpus.

    Attributes:
        min_chars: drop documents shorter than this.
        max_chars: cut longer documents at paragraph boundaries into pieces of at most this many characters.
        max_file_bytes: skip source or documentation files larger than this (generated tables).
    """

    min_chars: int = 400
    max_chars: int = 40_000
    max_file_bytes: int = 2_000_000


CORPORA = ("pydoc", "installed_docs")
"""Named corpora of ``TextDataConfig.corpus``."""


# ---------------------------------------------------------------------------------------------- sources
def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {node.name}({bases})" if bases else f"class {node.name}"
    try:
        args = ast.unparse(node.args)
    except Exception:  # noqa: BLE001 - an odd signature: the name is enough
        args = "..."
    return f"def {node.name}({args})"


def module_document(source: str, name: str) -> str:
    """The documentation text of one module's ``source`` (see the module docstring); empty when it has none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts: List[str] = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"{name}\n\n{doc.strip()}")

    def walk(body: Sequence[ast.AST], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name.startswith("_") and not (node.name.startswith("__") and node.name.endswith("__")):
                    continue
                d = ast.get_docstring(node)
                if d:
                    parts.append(f"{prefix}{_signature(node)}\n{d.strip()}")
                if isinstance(node, ast.ClassDef):
                    walk(node.body, f"{prefix}{node.name}.")

    walk(tree.body, "")
    if not parts:
        return ""
    return "\n\n".join(parts if doc else [name] + parts)


def _python_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", ".egg-info"))
                             and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py") and not f.startswith("test_"):
                yield Path(dirpath) / f


def _doc_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in {"__pycache__"} and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith((".md", ".rst", ".txt")) and not _SKIP_FILES.match(f):
                yield Path(dirpath) / f


def _metadata_description(path: Path) -> str:
    """The body (long description) of a ``METADATA`` file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    head, sep, body = text.partition("\n\n")
    return body if sep else ""


def _pieces(text: str, max_chars: int) -> List[str]:
    """``text`` cut at paragraph boundaries into pieces of at most ``max_chars`` (a longer paragraph is cut)."""
    if len(text) <= max_chars:
        return [text]
    out, current = [], ""
    for para in re.split(r"\n\s*\n", text):
        if len(para) > max_chars and current:  # a long paragraph keeps what precedes it (a header) in front
            para, current = f"{current}\n\n{para}", ""
        while len(para) > max_chars:
            out.append(para[:max_chars])
            para = para[max_chars:]
        if current and len(current) + len(para) + 2 > max_chars:
            out.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        out.append(current)
    return out


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or path.stem


def _roots() -> Tuple[Path, List[Path]]:
    """The standard library folder and the site-packages folders of the running interpreter."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    sites = sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    return stdlib, [s for s in sites if s.is_dir()]


def _distributions() -> List[Tuple[str, str]]:
    from importlib import metadata

    seen = {}
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name:
            seen[name] = dist.version
    return sorted(seen.items())


def collect_documents(spec: CorpusSpec, stdlib: Path, sites: Sequence[Path]) -> List[Dict[str, str]]:
    """Every document of the sources (see the module docstring), deduplicated, sorted by source."""
    docs: List[Dict[str, str]] = []

    def add(text: str, source: str) -> None:
        text = text.strip()
        if len(text) < spec.min_chars:
            return
        for i, piece in enumerate(_pieces(text, spec.max_chars)):
            if len(piece.strip()) >= spec.min_chars:
                docs.append({"text": piece.strip(), "source": source if i == 0 else f"{source}#{i}"})

    def read(path: Path) -> Optional[str]:
        try:
            if path.stat().st_size > spec.max_file_bytes:
                return None
            return path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    for root, label in [(stdlib, "stdlib")] + [(s, "site") for s in sites]:
        for path in _python_files(root):
            src = read(path)
            if src:
                add(module_document(src, _module_name(path, root)), f"{label}:{path.relative_to(root)}")
    for site in sites:
        for path in _doc_files(site):
            if any(part.endswith(".dist-info") for part in path.relative_to(site).parts):
                continue
            text = read(path)
            if text:
                add(text, f"docs:{path.relative_to(site)}")
        for meta in sorted(site.glob("*.dist-info/METADATA")):
            text = read(meta)
            if text:
                add(_metadata_description(meta), f"metadata:{meta.parent.name}")
    from pydoc_data.topics import topics

    for key in sorted(topics):
        add(topics[key], f"pydoc:{key}")
    unique: Dict[str, Dict[str, str]] = {}
    for doc in docs:
        body = doc["text"]
        head, sep, rest = body.partition("\n\n")
        if doc["source"].startswith(("stdlib:", "site:")) and sep and not re.search(r"\s", head):
            body = rest  # the module-name header differs between vendored copies
        digest = hashlib.sha1(_normalise(body).encode("utf-8")).hexdigest()
        unique.setdefault(digest, doc)
    return sorted(unique.values(), key=lambda d: d["source"])


# ---------------------------------------------------------------------------------------------- the cache
def _fingerprint(spec: CorpusSpec, dists: Sequence[Tuple[str, str]]) -> str:
    payload = json.dumps({"builder": BUILDER_VERSION, "python": sys.version.split()[0], "spec": asdict(spec),
                          "dists": list(dists)}, sort_keys=True)
    return hashlib.sha1(payload.encode("utf-8")).hexdigest()[:12]


def installed_docs_path(spec: CorpusSpec = CorpusSpec(), cache_dir: Optional[os.PathLike] = None) -> Path:
    """The folder the corpus of this environment lives in (built or not)."""
    return Path(cache_dir or default_cache_dir()) / "corpora" / f"installed_docs-{_fingerprint(spec, _distributions())}"


def build_installed_docs(spec: CorpusSpec = CorpusSpec(), cache_dir: Optional[os.PathLike] = None,
                         verbose: bool = True) -> Path:
    """The folder holding ``docs.jsonl`` and ``manifest.json`` of this environment's documentation corpus, built
    on first use (about a minute) and reused afterwards."""
    folder = installed_docs_path(spec, cache_dir)
    if (folder / "docs.jsonl").is_file() and (folder / "manifest.json").is_file():
        return folder
    if verbose:
        print(f"[litctx] building the installed-documentation corpus once into {folder}", flush=True)
    stdlib, sites = _roots()
    docs = collect_documents(spec, stdlib, sites)
    chars = sum(len(d["text"]) for d in docs)
    manifest = {"builder": BUILDER_VERSION, "python": sys.version.split()[0], "spec": asdict(spec),
                "documents": len(docs), "characters": chars, "stdlib": str(stdlib), "sites": [str(s) for s in sites],
                "distributions": [list(d) for d in _distributions()]}
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        with open(tmp / "docs.jsonl", "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if verbose:
        print(f"[litctx] corpus: {len(docs)} documents, {chars / 1e6:.1f}M characters", flush=True)
    return folder


def corpus_documents(name: str, cache_dir: Optional[os.PathLike] = None) -> List[str]:
    """The documents of a named corpus (:data:`CORPORA`)."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return [topics[k] for k in sorted(topics)]
    if name == "installed_docs":
        folder = build_installed_docs(cache_dir=cache_dir)
        return [rec["text"] for _, rec in jsonl_lines(folder / "docs.jsonl")]
    raise ValueError(f"corpus={name!r}: valid corpora are {', '.join(CORPORA)}")
