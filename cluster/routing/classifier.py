"""Workload classifier: one request in, one of ``WORKLOAD_CLASSES`` out, in well under 1 ms.

Contract: ``classify(text=..., messages=..., explicit=...)`` is a pure function. A valid explicit
class wins; an invalid one raises ValueError naming the allowed values. Otherwise the first rule
of ``RULES`` (below, in order) that fires decides; nothing fires -> ``chat``.

Why classes matter: the router picks the speculative mode from the class. Prompt-lookup (n-gram)
drafts pay off when the answer copies the prompt (summarization, rag, extraction, structured
output over given fields, code editing) and are useless for translation and creative writing.
So the rules separate requests by *how much the answer will copy the prompt*; confusing two
classes of the same ``cluster.routing.classifier_eval.COPY_GROUPS`` entry costs little, and its ``evaluate``
reports both.

Words used below:
- *instruction*: the part of a prompt that says what to do. A short prompt (<= SHORT_CHARS) is
  all instruction. A long one is a pasted *passage* plus an instruction at its head or its tail,
  so the instruction is its first line (at most INSTR_CHARS) plus its last line (ditto).
- *view*: the bounded part of the prompt any rule may read: the first HEAD_CHARS and the last
  TAIL_CHARS characters. Work per call is bounded by these constants, whatever the prompt size.
- *source*: something given to work on: a reference such as "the following text" or
  "Context:", or a passage (prompt longer than SOURCE_MIN_CHARS).
- *imperative*: an instruction verb at the start of a sentence or after "please / can you /
  help me ...", so a passage that merely mentions "translated" does not count.

Rules, in order (first match wins); each is a function ``_is_<class>(view) -> bool``:
 1. translation   - imperative "translate"/"translation of", "German to English",
                    "say/rewrite ... in French", "what does ... mean in English", or a
                    language name with a quoted foreign-script snippet.
 2. summarization - imperative summarize/sum up/condense/TL;DR or "give a summary", with a source.
 3. code          - code syntax (fences, ``def f(``, ``#include``...), "write/implement ... a
                    function/program/script/website", a programming language with a code noun,
                    or data-structure/complexity words.
 4. extraction    - an extract/identify/list/classify/rate... verb with a source.
 5. structured    - an output format is named (JSON, YAML, XML, CSV, schema, a table).
 6. rag           - a context marker with a question, or a long passage (>= RAG_MIN_CHARS)
                    ending in a short question on its own line.
 7. chat          - a persona ("act as", "pretend to be", "imagine yourself as a ...") or a greeting.
 8. creative      - a writing verb with a creative form (poem, story, blog post, headline...)
                    or a creative-style word (vivid, imaginative, fictional, rhyming...).
 9. math          - an arithmetic/comparison expression, a strong math word (equation,
                    probability, integral...), or numbers (>= 2) with a quantity question.
10. reasoning     - puzzle/logic words, "explain your reasoning", or a hypothetical
                    ("imagine/suppose/if you ...") followed by a question.
11. qa            - a question (wh-word/auxiliary opening, or "?") or an explain/describe/
                    discuss/compare request.
12. summarization - fallback for a long passage with an unrecognised instruction: the answer
                    most likely restates it (same copy group as rag and extraction).
    chat          - everything else.
With ``messages``, the last user message is classified; if it comes out qa/chat/reasoning and a
system message carries a context marker, or a tool/function message is present (retrieval
results), the class is rag.

The word sets, phrases and regexes the rules match are ``cluster.routing.classifier_vocab``'s.

Spec-Bench categories map to classes in ``cluster.routing.classifier_eval.SPEC_BENCH_TO_CLASS`` (justified there);
``python -m cluster.routing.classifier_eval /work/shared/data/specbench-dev.jsonl`` prints its ``evaluate``'s report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from cluster.routing.classifier_vocab import (
    CODE_LINE, CODE_NOUNS, CODE_PHRASES, CODE_SUBSTRINGS, CODE_TASK, CODE_TASK_NOUNS, CODE_VERBS, CONTEXT_LINE,
    CONTEXT_PHRASE, CONTEXT_PHRASE_LEADS, CREATIVE, CREATIVE_NOUN_SET, CREATIVE_STYLE, CREATIVE_VERBS,
    CURRENCY_OR_PERCENT, EXTRACT_VERB, EXTRACT_WORDS, FORMAT_PHRASES, FORMAT_WORDS, GREETING_STARTS, HYPOTHETICAL,
    HYPOTHETICAL_STARTS, IMAGINE_ROLE, LANGS, LEAD_INS, MATH_EXPRS, MATH_QUANTITY, MATH_QUANTITY_PHRASES,
    MATH_STRONG, NUMBER, NUMBER_WORDS, PERSONA_PHRASES, PROG_LANGS, QA_STARTS, QUESTION_STARTS, QUOTED_FOREIGN,
    REASONING_PHRASES, REASONING_WORDS, SAY_VERBS, SOURCE_LEADS, SOURCE_NOUNS, SOURCE_REF, SUMMARIZE_VERB,
    SUMMARIZE_WORDS, SUMMARY_NOUN, TRANSLATE_VERB, WORD,
)
from cluster.speculation import WORKLOAD_CLASSES

SHORT_CHARS = 800  # a prompt up to this long is all instruction
HEAD_CHARS = 1500  # the view: first HEAD_CHARS ...
TAIL_CHARS = 500  # ... and last TAIL_CHARS characters
INSTR_CHARS = 300  # instruction lines of a long prompt are cut to this
SOURCE_MIN_CHARS = 400  # a prompt this long carries its own source
RAG_MIN_CHARS = 1000  # a passage this long followed by a question is retrieval-augmented QA
DEFAULT_CLASS = "chat"


@dataclass(frozen=True)
class _View:
    """The bounded, lower-cased part of one prompt the rules read (built once per call)."""

    instr: str  # instruction, lower-cased: the whole short prompt, or first line + "\n" + last line
    raw_view: str  # head + "\n" + tail as given (the whole prompt when short); for code syntax
    view: str  # raw_view lower-cased
    tail_line: str  # last line, lower-cased and stripped (the whole prompt when short)
    words: frozenset  # words of the instruction
    phrase: str  # the instruction's words joined by single spaces, padded: " write a poem "
    length: int  # characters in the whole prompt

    @property
    def long(self) -> bool:
        return self.length > SHORT_CHARS

    @property
    def has_source(self) -> bool:
        if self.length >= SOURCE_MIN_CHARS or "```" in self.view or CONTEXT_LINE.search("\n" + self.view):
            return True
        return bool(self.words & SOURCE_LEADS and self.words & SOURCE_NOUNS and SOURCE_REF.search(self.instr))


def _make_view(text: str) -> _View:
    """Cut ``text`` to its bounded view; O(HEAD_CHARS + TAIL_CHARS) whatever len(text) is."""
    n = len(text)
    if n <= SHORT_CHARS:
        raw = text.strip()
        instr = tail_line = raw.lower()
    else:
        head = text[:HEAD_CHARS].lstrip()
        tail = text[-TAIL_CHARS:].rstrip()
        nl = head.find("\n", 0, INSTR_CHARS)
        head_line = head[:nl] if nl > 0 else head[:INSTR_CHARS]
        k = tail.rfind("\n")
        tail_line = (tail[k + 1 :] if k >= 0 else tail)[-INSTR_CHARS:].strip().lower()
        instr = (head_line + "\n" + tail_line).lower()
        raw = head + "\n" + tail
    words = WORD.findall(instr)
    return _View(instr=instr, raw_view=raw, view=raw.lower() if n > SHORT_CHARS else instr,
                 tail_line=tail_line, words=frozenset(words), phrase=" " + " ".join(words) + " ", length=n)


def _imperative(s: str, verb: re.Pattern) -> bool:
    """True if ``verb`` occurs in ``s`` at a line/sentence start or right after a lead-in."""
    for m in verb.finditer(s):
        before = s[max(0, m.start() - 16) : m.start()].rstrip(" \t*-#>")
        if not before or before[-1] in "\n.!?:;\"“(" or (" " + before).endswith(LEAD_INS):
            return True
    return False


# --- the rules (see the module docstring for their order) -------------------------------------
def _is_translation(v: _View) -> bool:
    if "translat" in v.instr and _imperative(v.instr, TRANSLATE_VERB):
        return True
    langs = v.words & LANGS
    if not langs:
        return False
    p = v.phrase
    for lang in langs:
        for lead in (" to ", " into "):  # "german to english"
            i = p.find(f" {lang}{lead}")
            if i >= 0 and p[i + len(lang) + len(lead) + 1 :].split(" ", 1)[0] in LANGS:
                return True
        if f" mean in {lang} " in p or f" means in {lang} " in p:  # "what does ... mean in english"
            return True
        for lead in (" in ", " into "):  # "say ... in french", "rewrite it into spanish"
            i = p.find(f"{lead}{lang} ")
            if i >= 0 and any(verb in p[max(0, i - 60) : i + 1] for verb in SAY_VERBS):
                return True
    return not v.long and bool(QUOTED_FOREIGN.search(v.instr))


def _is_summarization(v: _View) -> bool:
    if not v.words & SUMMARIZE_WORDS or not v.has_source:
        return False
    return _imperative(v.instr, SUMMARIZE_VERB) or bool(SUMMARY_NOUN.search(v.instr))


def _is_code(v: _View) -> bool:
    if any(t in v.raw_view for t in CODE_SUBSTRINGS) or CODE_LINE.search("\n" + v.raw_view):
        return True
    if v.words & CODE_VERBS and v.words & CODE_TASK_NOUNS and CODE_TASK.search(v.instr):
        return True
    if any(p in v.phrase for p in CODE_PHRASES):
        return True
    return bool(v.words & PROG_LANGS or "c++" in v.instr or "c#" in v.instr) and bool(v.words & CODE_NOUNS)


def _is_extraction(v: _View) -> bool:
    if " named entities " in v.phrase or " key value pair" in v.phrase:
        return v.has_source
    return bool(v.words & EXTRACT_WORDS) and v.has_source and _imperative(v.instr, EXTRACT_VERB)


def _is_structured(v: _View) -> bool:
    return bool(v.words & FORMAT_WORDS) or any(p in v.phrase for p in FORMAT_PHRASES)


def _has_context_marker(s: str) -> bool:
    if CONTEXT_LINE.search("\n" + s):
        return True
    return any(p in s for p in CONTEXT_PHRASE_LEADS) and bool(CONTEXT_PHRASE.search(s))


def _is_rag(v: _View) -> bool:
    if (CONTEXT_LINE.search("\n" + v.view) and "?" in v.view) or (_has_context_marker(v.instr) and (v.long or "?" in v.instr)):
        return True
    if v.length < RAG_MIN_CHARS or len(v.tail_line) > INSTR_CHARS:
        return False
    first = WORD.match(v.tail_line)
    return v.tail_line.endswith("?") or bool(first and first.group() in QUESTION_STARTS)


def _is_chat(v: _View) -> bool:
    if any(p in v.phrase for p in PERSONA_PHRASES) or v.phrase.startswith(GREETING_STARTS):
        return True
    return "imagine" in v.words and bool(IMAGINE_ROLE.search(v.phrase))


def _is_creative(v: _View) -> bool:
    if v.words & CREATIVE_STYLE or " in the style of " in v.phrase:
        return True
    return bool(v.words & CREATIVE_VERBS and v.words & CREATIVE_NOUN_SET and CREATIVE.search(v.instr))


def _is_math(v: _View) -> bool:
    for chars, expr in MATH_EXPRS:
        if any(c in v.instr for c in chars) and expr.search(v.instr):
            return True
    strong = v.words & MATH_STRONG
    if strong and not (strong == {"equation"} and " chemical equation " in v.phrase) or " prove that " in v.phrase:
        return True
    numbers = len(NUMBER.findall(v.instr)) + len(v.words & NUMBER_WORDS)
    if numbers >= 3 and "?" in v.instr:
        return True
    return numbers >= 2 and bool(
        v.words & MATH_QUANTITY or any(p in v.phrase for p in MATH_QUANTITY_PHRASES)
        or CURRENCY_OR_PERCENT.search(v.instr)
    )


def _is_reasoning(v: _View) -> bool:
    if v.words & REASONING_WORDS or any(p in v.phrase for p in REASONING_PHRASES):
        return True
    return "?" in v.instr and (v.instr.startswith(HYPOTHETICAL_STARTS) or bool(HYPOTHETICAL.search(v.instr)))


def _is_qa(v: _View) -> bool:
    s = v.tail_line if v.long else v.instr
    first = WORD.match(s)
    return "?" in s or bool(first and first.group() in QA_STARTS) or " in the field of " in v.phrase[:20]


def _is_long_passage(v: _View) -> bool:
    return v.length >= RAG_MIN_CHARS

RULES: tuple[tuple[str, Callable[[_View], bool]], ...] = (
    ("translation", _is_translation),
    ("summarization", _is_summarization),
    ("code", _is_code),
    ("extraction", _is_extraction),
    ("structured", _is_structured),
    ("rag", _is_rag),
    ("chat", _is_chat),
    ("creative", _is_creative),
    ("math", _is_math),
    ("reasoning", _is_reasoning),
    ("qa", _is_qa),
    ("summarization", _is_long_passage),
)


def classify_text(text: str) -> tuple[str, str]:
    """(class, name of the rule that fired) for a plain prompt; ("chat", "default") if none did."""
    v = _make_view(text or "")
    if not v.view:  # empty, or blank throughout the view (only the view is ever read)
        return DEFAULT_CLASS, "default"
    for cls, rule in RULES:
        if rule(v):
            return cls, rule.__name__
    return DEFAULT_CLASS, "default"


def _content(message: Any) -> str:
    """Text of one chat message (dict or object; content a string or a list of text parts)."""
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = (p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") for p in content)
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def _role(message: Any) -> str:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return str(role or "")


def classify(text: Optional[str] = None, messages: Optional[list[dict]] = None, explicit: Optional[str] = None) -> str:
    """One of WORKLOAD_CLASSES for a request given as ``text`` or as chat ``messages`` (not both).

    ``explicit`` (the request's own ``workload_class``) wins when given; an unknown one raises
    ValueError naming the allowed values. Empty input -> "chat".
    """
    if explicit not in (None, ""):
        if explicit not in WORKLOAD_CLASSES:
            raise ValueError(f"unknown workload class {explicit!r}; allowed: {', '.join(WORKLOAD_CLASSES)}")
        return explicit
    if text is not None and messages is not None:
        raise ValueError("give either `text` or `messages`, not both")
    if messages is None:
        return classify_text(text or "")[0]
    users = [m for m in messages if _role(m) == "user"]
    cls = classify_text(_content(users[-1]) if users else "\n".join(_content(m) for m in messages))[0]
    if cls in ("qa", "chat", "reasoning"):
        for m in messages:
            role = _role(m)
            if role in ("tool", "function") or role == "system" and _has_context_marker(_content(m)[:HEAD_CHARS].lower()):
                return "rag"
    return cls
