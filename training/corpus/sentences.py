"""The sentence pool: English sentences extracted offline from installed packages.

No text data set can be downloaded here, so the pool is rebuilt from what Debian and PyPI
packages ship (extraction is code, not a committed data dump):

=================  ===============================================  ==============
source             package                                          kind
=================  ===============================================  ==============
``fortunes``       Debian ``fortune-mod fortunes fortunes-min``     conversational
``wordnet``        Debian ``wordnet`` (``wordnet-base``): examples  conversational
``dialogue``       PyPI ``chatterbot-corpus`` (English YAML)        conversational
``python-doc``     Debian ``python3.11-doc`` (reST sources)         technical
``libreoffice``    Debian ``libreoffice-help-en-us`` (HTML)         instructions
``debian-ref``     Debian ``debian-reference-en`` (HTML)            technical
``file``           a text file given with ``--sentences``           any
=================  ===============================================  ==============

Every candidate goes through :func:`clean_sentence` (ASCII only, speakable characters,
4-35 words, no code-like tokens), is deduplicated on its normalised text (the first
source in :data:`SOURCE_ORDER` wins) and the pool is sorted, so it is deterministic for
given package versions. Missing packages simply contribute nothing.
Sampling weights (:data:`DEFAULT_WEIGHTS`) favour conversational text over technical prose.
"""
from __future__ import annotations

import glob
import hashlib
import html
import html.parser
import importlib.util
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from livespeech.models.graphemes import normalize_text

MIN_WORDS = 4
MAX_WORDS = 35

SOURCE_ORDER = ("dialogue", "fortunes", "wordnet", "python-doc", "libreoffice", "debian-ref", "file")

# probability of drawing an utterance's sentence from each source (renormalised over the
# sources that are present). Technical sentences are longer (python-doc 5.8 s on average,
# wordnet 2.4 s), so these draw probabilities give conversational text (fortunes,
# dialogue, wordnet examples) ~80% of the utterances and ~74% of the hours.
DEFAULT_WEIGHTS = {
    "fortunes": 0.40,
    "wordnet": 0.32,
    "dialogue": 0.10,
    "libreoffice": 0.07,
    "python-doc": 0.06,
    "debian-ref": 0.05,
    "file": 1.0,
}

WORDNET_DIR = "/usr/share/wordnet"
FORTUNE_DIRS = ("/usr/share/games/fortunes", "/usr/share/fortune")
FORTUNE_SKIP = {"ascii-art", "translate-me"}
PYTHON_DOC_GLOB = "/usr/share/doc/python3*/html/_sources"
LIBREOFFICE_HELP = "/usr/share/libreoffice/help/en-US"
DEBIAN_REFERENCE = "/usr/share/debian-reference"


@dataclass(frozen=True)
class Sentence:
    text: str
    source: str

    @property
    def key(self) -> str:
        return normalize_text(self.text)


# ----------------------------------------------------------------------------- cleaning
_TRANSLATE = {
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "`": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u00ab": '"', "\u00bb": '"',
    "\u2013": " - ", "\u2014": " - ", "\u2012": " - ", "\u2015": " - ",
    "\u2026": "...", "\u00a0": " ",
}
# characters allowed in a sentence (others reject it): letters, digits, space and the
# punctuation eSpeak reads silently or as a word attached to a number ($, %)
_ALLOWED = re.compile(r"^[A-Za-z0-9 .,;:!?'\"()$%-]+$")
_WORDLIKE = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
_TOKEN_CORE = re.compile(r"^[\"'(]*(.*?)[\"'),.;:!?]*$")
_HYPHENATED = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?(?:-[A-Za-z]+(?:'[A-Za-z]+)?)+")
# tokens that are not plain words but read well: numbers, money, percentages, ordinals,
# decades, times, initialisms ("U.S.A"), a trailing possessive, "well...no"
_OTHER_OK = re.compile(
    r"\$?\d{1,3}(?:,\d{3})*(?:\.\d+)?(?:%|s|'s|st|nd|rd|th|am|pm)?"
    r"|\$?\d+(?:\.\d+)?(?:%|s|'s|st|nd|rd|th|am|pm)?"
    r"|\d{1,2}:\d{2}(?:am|pm)?"
    r"|(?:[A-Za-z]\.)+[A-Za-z]?(?:'s)?"
    r"|[A-Za-z]+(?:\.\.\.[A-Za-z]+)+"
    r"|[A-Za-z]+'"
)


def ascii_fold(text: str) -> str:
    """Unicode quotes/dashes to ASCII, accents stripped, whitespace collapsed."""
    for a, b in _TRANSLATE.items():
        text = text.replace(a, b)
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    return " ".join(text.split())


def clean_sentence(text: str, *, fragment_ok: bool = False) -> str | None:
    """The sentence ready to speak, or None when it is not a good TTS sentence.

    ``fragment_ok``: the text may start in lower case and lack final punctuation
    (WordNet examples, dialogue lines); it is then capitalised and given a period.
    """
    text = ascii_fold(text)
    text = re.sub(r"-{2,}", " - ", text)
    text = " ".join(text.split())
    if not text or not _ALLOWED.match(text) or "''" in text:
        return None
    if re.match(r"^\(?\d+[:.)] ", text):  # list numbering
        return None
    # unbalanced quotes / brackets: drop double quotes, reject brackets
    if text.count('"') % 2:
        text = " ".join(text.replace('"', " ").split())
    if text.count("(") != text.count(")"):
        return None
    if fragment_ok:
        text = text[0].upper() + text[1:]
        if text[-1] not in ".!?\"')":
            text += "."
        elif text[-1] in "\"')" and text.rstrip("\"')")[-1:] not in ".!?":
            text += "."
    if not (text[0].isupper() or text[0].isdigit() or text[0] in "\"'("):
        return None
    if text.rstrip("\"')")[-1:] not in (".", "!", "?"):
        return None
    tokens = text.split()
    words = [t for t in tokens if any(c.isalnum() for c in t)]
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return None
    # standalone punctuation other than a dash is odd ("hello , world")
    for t in tokens:
        if not any(c.isalnum() for c in t) and t not in ("-", "..."):
            return None
    letters = [c for c in text if c.isalpha()]
    if len(letters) < 10:
        return None
    upper = sum(c.isupper() for c in letters)
    if upper > 0.3 * len(letters):  # shouting, acronyms, headings
        return None
    digits = sum(c.isdigit() for c in text)
    if digits > 0.15 * len(letters):
        return None
    n_plain = 0
    for t in words:
        core = _TOKEN_CORE.match(t).group(1)
        if len(core) > 20:
            return None
        if _WORDLIKE.fullmatch(core) or _HYPHENATED.fullmatch(core):
            n_plain += 1
        elif not _OTHER_OK.fullmatch(core):
            return None  # code, paths, cell references, "Sheet1", "''P''"
    if n_plain < 0.75 * len(words):
        return None
    # a sentence end in the middle that the splitter missed: "Yes. No. Maybe."
    if re.search(r"(?:[!?]|[a-z]{2}\.) [a-z]", text):
        return None
    return text


_ABBREV = ("Mr", "Mrs", "Ms", "Dr", "St", "Jr", "Sr", "Prof", "vs", "etc", "e.g", "i.e", "Mt",
           "No", "Vol", "Fig", "approx", "Inc", "Ltd", "Co", "Gen", "Col", "Capt", "Sgt", "Lt")
_SPLIT = re.compile(r"(?<=[.!?])[\"')]?\s+(?=[\"'(]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences (after ``.``, ``!``, ``?`` before a capital)."""
    text = " ".join(text.split())
    out: list[str] = []
    start = 0
    for m in _SPLIT.finditer(text):
        before = text[start:m.start()]
        last = before.split()[-1] if before.split() else ""
        core = last.rstrip(".!?\"')").lstrip("\"'(")
        # abbreviations and initials ("J. R. R. Tolkien") do not end sentences
        if last.endswith(".") and (core in _ABBREV or (len(core) == 1 and core.isalpha())):
            continue
        piece = text[start:m.end()].strip()
        if piece:
            out.append(piece)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


# ----------------------------------------------------------------------------- parsers
def parse_wordnet_data(content: str) -> Iterator[str]:
    """Quoted example sentences from a WordNet ``data.*`` file's glosses."""
    for line in content.splitlines():
        if line.startswith("  ") or "|" not in line:
            continue  # licence header
        gloss = line.split("|", 1)[1]
        for m in re.finditer(r'"([^"]+)"', gloss):
            yield m.group(1).strip()


def parse_fortunes(content: str) -> Iterator[str]:
    """Sentences of a fortune file (records separated by ``%`` lines); attribution lines
    ("-- Mark Twain"), indented verse/art and Q:/A: prefixes are dropped."""
    for record in re.split(r"^%\s*$", content, flags=re.M):
        lines = []
        for line in record.splitlines():
            s = line.strip()
            if not s:
                lines.append("\n")
                continue
            if s.startswith("--") or s.startswith("- ") and len(lines) > 0 and line.startswith((" ", "\t")):
                continue  # attribution
            if line.startswith(("\t\t", "        ")):
                continue  # heavily indented: attributions, verse, art
            s = re.sub(r"^(Q|A|Q\.|A\.):\s*", "", s)
            s = re.sub(r"^[A-Z][A-Za-z]{0,20}:\s+", "", s)  # "Moral:", speaker names
            lines.append(s)
        for para in " ".join(lines).split("\n"):
            yield from split_sentences(para)


def parse_chatterbot_yaml(content: str) -> Iterator[str]:
    """Dialogue lines of a chatterbot-corpus YAML file (``- - line`` / ``  - line``)."""
    for line in content.splitlines():
        m = re.match(r"^\s*-\s+(?:-\s+)?(.*)$", line)
        if not m:
            continue
        s = m.group(1).strip()
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
            s = s[1:-1].replace("''", "'")
        if s.startswith(("|", ">")):
            continue
        yield from split_sentences(s)


_ROLE = re.compile(r":[a-z:]+:`~?(?:([^`<]*?)\s*<[^`>]*>|([^`]*))`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_+")


def parse_rst(content: str) -> Iterator[str]:
    """Prose sentences of a reStructuredText file: plain paragraphs only (no directives,
    literal blocks, lists, tables, headings); inline roles reduced to their text."""
    paras: list[list[str]] = [[]]
    in_literal = False
    for line in content.splitlines():
        if not line.strip():
            paras.append([])
            continue
        indented = line[:1] in (" ", "\t")
        if in_literal:
            if indented:
                continue
            in_literal = False
        if indented or line.startswith(".."):
            if line.startswith(".."):
                in_literal = True  # directive body follows, indented
            paras.append([])
            continue
        s = line.strip()
        if re.match(r"^[=\-~^*#+`'\"]{3,}$", s):
            paras[-1] = []  # the line above was a heading
            continue
        if s[:1] in "*-+|#>" or re.match(r"^\d+\.\s", s):
            paras.append([])
            continue
        paras[-1].append(s)
        if s.endswith("::"):
            in_literal = True
    for p in paras:
        if not p:
            continue
        text = " ".join(p)
        text = _ROLE.sub(lambda m: (m.group(1) or m.group(2) or "").split(".")[-1], text)
        text = _LINK.sub(r"\1", text)
        text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
        text = re.sub(r"(?<!\w)\*([^*]+)\*", r"\1", text)
        text = text.replace("::", ":")
        yield from split_sentences(text)


class _ParagraphParser(html.parser.HTMLParser):
    """Text of the <p> elements of an HTML page (skipping <pre>, <code>, <script>...)."""

    SKIP = {"pre", "code", "script", "style", "kbd", "samp", "tt", "var"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paras: list[str] = []
        self._buf: list[str] | None = None
        self._skip = 0
        self._dirty = False

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self._skip += 1
            if self._buf is not None:
                self._dirty = True  # a sentence with code in it is not prose
        elif tag == "p":
            self._flush()
            self._buf = []
            self._dirty = False
        elif tag in ("br", "li", "div", "table", "td", "tr") and self._buf is not None:
            self._flush()

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag == "p":
            self._flush()

    def handle_data(self, data):
        if self._buf is not None and not self._skip:
            self._buf.append(data)

    def _flush(self):
        if self._buf is not None and not self._dirty:
            self.paras.append(" ".join("".join(self._buf).split()))
        self._buf = None
        self._dirty = False

    def close(self):
        super().close()
        self._flush()


def parse_html_paragraphs(content: str) -> Iterator[str]:
    parser = _ParagraphParser()
    parser.feed(content)
    parser.close()
    for p in parser.paras:
        yield from split_sentences(html.unescape(p))


# ----------------------------------------------------------------------------- sources
def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def wordnet_candidates() -> Iterator[str]:
    for name in ("data.noun", "data.verb", "data.adj", "data.adv"):
        path = os.path.join(WORDNET_DIR, name)
        if os.path.exists(path):
            yield from parse_wordnet_data(_read(path))


def fortune_candidates() -> Iterator[str]:
    seen = set()
    for d in FORTUNE_DIRS:
        for path in sorted(glob.glob(os.path.join(d, "*"))):
            base = os.path.basename(path)
            if "." in base or base in FORTUNE_SKIP or not os.path.isfile(path) or base in seen:
                continue
            seen.add(base)
            yield from parse_fortunes(_read(path))


def chatterbot_dir() -> str | None:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.origin:
        return None
    d = os.path.join(os.path.dirname(spec.origin), "data", "english")
    return d if os.path.isdir(d) else None


def dialogue_candidates() -> Iterator[str]:
    d = chatterbot_dir()
    if d is None:
        return
    for path in sorted(glob.glob(os.path.join(d, "*.yml"))):
        yield from parse_chatterbot_yaml(_read(path))


def python_doc_candidates() -> Iterator[str]:
    for root in sorted(glob.glob(PYTHON_DOC_GLOB))[-1:]:
        for path in sorted(glob.glob(os.path.join(root, "**", "*.txt"), recursive=True)):
            yield from parse_rst(_read(path))


def libreoffice_candidates() -> Iterator[str]:
    for path in sorted(glob.glob(os.path.join(LIBREOFFICE_HELP, "text", "**", "*.html"), recursive=True)):
        yield from parse_html_paragraphs(_read(path))


def debian_reference_candidates() -> Iterator[str]:
    for path in sorted(glob.glob(os.path.join(DEBIAN_REFERENCE, "*.en.html"))):
        yield from parse_html_paragraphs(_read(path))


SOURCES: dict[str, tuple[Callable[[], Iterable[str]], bool, str]] = {
    # name: (candidates, fragment_ok, where it comes from)
    "dialogue": (dialogue_candidates, True, "PyPI chatterbot-corpus"),
    "fortunes": (fortune_candidates, False, "Debian fortune-mod fortunes fortunes-min"),
    "wordnet": (wordnet_candidates, True, "Debian wordnet"),
    "python-doc": (python_doc_candidates, False, "Debian python3.11-doc"),
    "libreoffice": (libreoffice_candidates, False, "Debian libreoffice-help-en-us"),
    "debian-ref": (debian_reference_candidates, False, "Debian debian-reference-en"),
}


def read_sentence_file(path: str) -> list[Sentence]:
    """A text file with one sentence a line, optionally ``source<TAB>sentence``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            source, text = ("file", line)
            if "\t" in line:
                source, text = line.split("\t", 1)
            out.append(Sentence(text.strip(), source.strip() or "file"))
    return out


def dedupe(sentences: Iterable[Sentence]) -> list[Sentence]:
    """Keep the first sentence of each normalised text; then sort by (source, text)."""
    seen: set[str] = set()
    out = []
    for s in sentences:
        k = s.key
        if k and k not in seen:
            seen.add(k)
            out.append(s)
    order = {name: i for i, name in enumerate(SOURCE_ORDER)}
    out.sort(key=lambda s: (order.get(s.source, len(order)), s.source, s.text))
    return out


def extract_pool(sources: Iterable[str] | None = None, sentence_file: str | None = None,
                 clean_file: bool = True) -> list[Sentence]:
    """The deduplicated, sorted sentence pool from the installed packages (and/or a file)."""
    found: list[Sentence] = []
    if sentence_file:
        for s in read_sentence_file(sentence_file):
            text = clean_sentence(s.text, fragment_ok=True) if clean_file else s.text
            if text:
                found.append(Sentence(text, s.source))
    names = list(SOURCES) if sources is None else list(sources)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown sentence sources {unknown}; known: {sorted(SOURCES)}")
    for name in names:
        fn, fragment_ok, _ = SOURCES[name]
        for cand in fn():
            text = clean_sentence(cand, fragment_ok=fragment_ok)
            if text:
                found.append(Sentence(text, name))
    return dedupe(found)


def pool_fingerprint(pool: Iterable[Sentence]) -> str:
    h = hashlib.sha256()
    for s in pool:
        h.update(s.source.encode())
        h.update(b"\t")
        h.update(s.text.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def source_counts(pool: Iterable[Sentence]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in pool:
        out[s.source] = out.get(s.source, 0) + 1
    return out
