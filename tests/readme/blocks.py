"""The README's code blocks, how each is classified, and what output each command documents.

Classification of a fenced block (``README.md``), by its info string and the marker comments right
before it (HTML comments, invisible when rendered; blank lines may separate them from the fence):

* ```` ```bash ```` — run, command by command, in one fresh ``bash`` (a reader's new terminal);
* ```` ```python ```` — run, statement by statement, in one fresh interpreter;
* ```` ```yaml ```` — parsed; every ``exec: {command: [...]}`` in it (a Kubernetes probe) is run and must exit 0;
* a fence without a language — text (a diagram, a layout, sample output): not run;
* anything else — an error unless marked ``skip``: a new kind of block cannot escape silently.

Markers (``<!-- readme: VERB ... -->``, one per comment):

* ``skip (REASON)`` — the block is not run (the reason says why, and what checks it instead);
* ``skip-line "PREFIX" (REASON)`` — commands starting with PREFIX are not run;
* ``server URL (REASON)`` — the block's last command is a long-running server: it is started before the
  first block, stays up for the whole run (it *is* the fleet's gateway), and is ready when URL answers;
* ``expect "PREFIX" ~ REGEX`` — the command starting with PREFIX prints something REGEX finds (``re.search``);
* ``poll "PREFIX" (REASON)`` — that command is re-run, up to 20 s, until its documented output appears
  (a reader polls it: it reports something that happens in another process a moment later).

Skipped ``fleet`` commands are still parsed by the ``fleet`` CLI's own parser, skipped ``make`` targets
dry-run (``make -n``), skipped ``python -m`` modules must exist, and every ``tests/...py`` a reason names
must exist: a renamed flag, target or module fails even where the command cannot run.

Documented output (the README's own comment conventions, checked against the command's stdout):

* a bash command's inline comment ``# prints OUTPUT`` (OUTPUT starting with ``{``, ``[``, ``HTTP/`` or ``data:``);
* comment lines right under a bash command, the first of which starts that way (``# HTTP/1.1 202 ...``);
* a comment on a Python statement's lines that starts that way (``print(x)   # {"request_id": ...}``).

Such a template matches when its fragments appear in the output in order; fragments are separated by
``...``, ``…`` and runs of two or more spaces (a gap of anything), whitespace is ignored and ``'``
equals ``"`` (Python prints dicts with single quotes). Every command must also exit 0.
"""

from __future__ import annotations

import ast
import io
import re
import shlex
import subprocess
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Block",
    "Command",
    "Marker",
    "ReadmeError",
    "bash_commands",
    "classification_problems",
    "fleet_argv",
    "match_template",
    "parse_readme",
    "python_statements",
    "strip_comment",
]

_FENCE = re.compile(r"^```(?P<info>[^`\s]*)\s*$")
_MARKER = re.compile(r"^<!--\s*readme:\s*(?P<body>.*?)\s*-->\s*$")
_ANY_MARKER = re.compile(r"<!--\s*readme:")
_QUOTED = r'"(?P<prefix>[^"]+)"'
_VERBS = {
    "skip": re.compile(r"^skip\s+\((?P<reason>.+)\)$"),
    "skip-line": re.compile(rf"^skip-line\s+{_QUOTED}\s+\((?P<reason>.+)\)$"),
    "server": re.compile(r"^server\s+(?P<url>https?://\S+)(?:\s+\((?P<reason>.+)\))?$"),
    "expect": re.compile(rf"^expect\s+{_QUOTED}\s+~\s+(?P<regex>.+)$"),
    "poll": re.compile(rf"^poll\s+{_QUOTED}\s+\((?P<reason>.+)\)$"),
}
_OUTPUT_START = ("{", "[", "HTTP/", "data:")
_GAP = re.compile(r"\.\.\.|…| {2,}")


class ReadmeError(ValueError):
    """A block or marker the runner cannot classify (the message names its README line)."""


@dataclass(frozen=True)
class Marker:
    """One ``<!-- readme: ... -->`` comment attached to a block."""

    verb: str
    line: int
    prefix: str = ""
    reason: str = ""
    url: str = ""
    regex: str = ""


@dataclass
class Command:
    """One logical command of a bash block (or one top-level statement of a Python block)."""

    text: str
    line: int  # README line of its first line
    template: str | None = None  # its documented output, if the README shows one
    skipped: str | None = None  # the skip-line reason
    expects: list[str] = field(default_factory=list)
    poll: bool = False
    trailing: list[str] = field(default_factory=list)  # comment lines right under it (bash)

    @property
    def head(self) -> str:
        """Its first line without the trailing comment, for messages."""
        return strip_comment(self.text.splitlines()[0]).strip()


@dataclass
class Block:
    """A fenced block: where it is, what it holds, and what the runner does with it."""

    line: int  # README line of the opening fence
    lang: str
    code: str
    section: str
    markers: list[Marker]

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang or 'text'}"

    def marker(self, verb: str) -> Marker | None:
        return next((m for m in self.markers if m.verb == verb), None)

    @property
    def kind(self) -> str:
        """``run``, ``server``, ``skip``, ``yaml`` or ``text``."""
        if self.marker("skip"):
            return "skip"
        if self.lang in ("bash", "python"):
            return "server" if self.marker("server") else "run"
        if self.lang == "yaml":
            return "yaml"
        if self.lang == "":
            return "text"
        raise ReadmeError(f"README line {self.line}: a ```{self.lang} block the runner cannot run; mark it "
                          "<!-- readme: skip (why, and what checks it instead) -->")

    def commands(self) -> list[Command]:
        """Its commands (bash) or statements (python), with templates and markers applied.

        Raises:
            ReadmeError: a skip-line/expect/poll marker matches no command (it went stale).
        """
        cmds = bash_commands(self.code, self.line + 1) if self.lang == "bash" else python_statements(
            self.code, self.line + 1)
        for m in self.markers:
            if m.verb not in ("skip-line", "expect", "poll"):
                continue
            hits = [c for c in cmds if c.text.lstrip().startswith(m.prefix)]
            if not hits:
                raise ReadmeError(f"README line {m.line}: no command of the block at line {self.line} "
                                  f"starts with {m.prefix!r}")
            for c in hits:
                if m.verb == "skip-line":
                    c.skipped = m.reason
                elif m.verb == "expect":
                    c.expects.append(m.regex)
                else:
                    c.poll = True
        return cmds


def classification_problems(blocks: list[Block]) -> list[str]:
    """Why the runner could not run some of ``blocks`` as they are marked (empty when it can run all)."""
    problems = []
    for block in blocks:
        try:
            if block.kind in ("run", "server"):
                block.commands()
        except (ReadmeError, SyntaxError) as exc:
            problems.append(f"block at README line {block.line}: {exc}")
    return problems


def _parse_marker(text: str, line: int) -> Marker:
    for verb, pattern in _VERBS.items():
        if (m := pattern.match(text)) is not None:
            groups = {k: v for k, v in m.groupdict().items() if v is not None}
            return Marker(verb=verb, line=line, **groups)
    raise ReadmeError(f"README line {line}: marker {text!r} is none of: skip (REASON), "
                      'skip-line "PREFIX" (REASON), server URL, expect "PREFIX" ~ REGEX, poll "PREFIX" (REASON)')


def parse_readme(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order, with its markers.

    Raises:
        ReadmeError: an unterminated fence, a malformed marker, or a marker not right before a fence.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: list[Marker] = []
    section = ""
    i = 0
    while i < len(lines):
        text = lines[i]
        if (fence := _FENCE.match(text)) is not None:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ReadmeError(f"README line {i + 1}: unterminated code fence")
            blocks.append(Block(i + 1, fence["info"], "\n".join(lines[i + 1 : end]) + "\n", section, pending))
            pending, i = [], end + 1
            continue
        if (marker := _MARKER.match(text.strip())) is not None:
            pending.append(_parse_marker(marker["body"], i + 1))
        elif _ANY_MARKER.search(text):
            raise ReadmeError(f"README line {i + 1}: a readme marker must be alone on its line")
        elif text.strip():
            if pending:
                raise ReadmeError(f"README line {pending[0].line}: marker not right before a code block")
            if text.startswith("#"):
                section = text.lstrip("#").strip()
        i += 1
    if pending:
        raise ReadmeError(f"README line {pending[0].line}: marker after the last code block")
    return blocks


# -- bash -------------------------------------------------------------------------------------------
def _comment_start(text: str) -> int | None:
    """Index of the ``#`` that starts a shell comment in ``text`` (quotes and escapes respected)."""
    quote: str | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote == "'":
            quote = None if ch == "'" else quote
        elif ch == "\\":
            i += 1
        elif quote == '"':
            quote = None if ch == '"' else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t\n;&|("):
            return i
        i += 1
    return None


def strip_comment(text: str) -> str:
    start = _comment_start(text)
    return text if start is None else text[:start].rstrip()


def _complete(text: str) -> bool:
    """Whether ``text`` is a whole shell command (``bash -n``: no unexpected end of file)."""
    if text.rstrip().endswith("\\"):
        return False
    done = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True, check=False)
    return "unexpected end of file" not in done.stderr and "unexpected EOF" not in done.stderr


def bash_commands(code: str, first_line: int) -> list[Command]:
    """``code`` cut into logical commands (continuations, multi-line quotes), with their documented output."""
    cmds: list[Command] = []
    buf: list[str] = []
    start = 0
    trailing: list[str] | None = None  # where comment lines right under the last command go
    for n, raw in enumerate(code.splitlines()):
        stripped = raw.strip()
        if not buf and not stripped:
            trailing = None
            continue
        if not buf and stripped.startswith("#"):
            if trailing is not None:
                trailing.append(stripped[1:].strip())
            continue
        if not buf:
            start = first_line + n
        buf.append(raw)
        if _complete("\n".join(buf)):
            cmds.append(Command(text="\n".join(buf), line=start))
            trailing, buf = cmds[-1].trailing, []
    if buf:
        raise ReadmeError(f"README line {start}: incomplete shell command {buf[0]!r}")
    for c in cmds:
        at = _comment_start(c.text)
        comment = c.text[at + 1 :].strip() if at is not None else ""
        if comment.startswith("prints ") and _shows_output(comment):
            c.template = _shows_output(comment)
        elif c.trailing and c.trailing[0].startswith(_OUTPUT_START):
            c.template = "\n".join(c.trailing)
    return cmds


def _shows_output(comment: str) -> str | None:
    """The output an inline comment shows (``# {...}``, ``# prints {...}``), or None for prose."""
    shown = comment.removeprefix("prints ").strip()
    return shown if shown.startswith(_OUTPUT_START) else None


def fleet_argv(text: str) -> list[str] | None:
    """The arguments of a ``.venv/bin/fleet`` command line (None for other commands)."""
    words = shlex.split(strip_comment(text.replace("\\\n", " ")), comments=False)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value before the command
        words = words[1:]
    if words and words[-1] == "&":
        words = words[:-1]
    return words[1:] if words and words[0].endswith("bin/fleet") else None


# -- python -----------------------------------------------------------------------------------------
def python_statements(code: str, first_line: int) -> list[Command]:
    """Top-level statements of ``code``; a ``{``/``[`` comment on a statement's lines is its output."""
    tree = ast.parse(code)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].strip()
    lines = code.splitlines()
    out = []
    for stmt in tree.body:
        end = stmt.end_lineno or stmt.lineno
        text = "\n".join(lines[stmt.lineno - 1 : end])
        shown = [_shows_output(comments.get(n, "")) for n in range(stmt.lineno, end + 1)]
        out.append(Command(text=text, line=first_line + stmt.lineno - 1, template=next(filter(None, shown), None)))
    return out


# -- templates --------------------------------------------------------------------------------------
def _normal(text: str) -> str:
    return re.sub(r"\s+", "", text).replace("'", '"')


def match_template(template: str, output: str) -> str | None:
    """None when ``output`` shows ``template`` (see the module docstring), else what is missing."""
    seen = _normal(output)
    pos = 0
    for piece in _GAP.split(template):
        frag = _normal(piece)
        if not frag:
            continue
        found = seen.find(frag, pos)
        if found < 0:
            return f"documented output fragment {piece.strip()!r} not found (in order) in the output"
        pos = found + len(frag)
    return None
