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

Spec-Bench categories map to classes in ``cluster.routing.classifier_eval.SPEC_BENCH_TO_CLASS`` (justified there);
``python -m cluster.routing.classifier_eval /work/shared/data/specbench-dev.jsonl`` prints its ``evaluate``'s report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from cluster.speculation import WORKLOAD_CLASSES

SHORT_CHARS = 800  # a prompt up to this long is all instruction
HEAD_CHARS = 1500  # the view: first HEAD_CHARS ...
TAIL_CHARS = 500  # ... and last TAIL_CHARS characters
INSTR_CHARS = 300  # instruction lines of a long prompt are cut to this
SOURCE_MIN_CHARS = 400  # a prompt this long carries its own source
RAG_MIN_CHARS = 1000  # a passage this long followed by a question is retrieval-augmented QA
DEFAULT_CLASS = "chat"

# --- vocabulary and regexes (compiled once; all matched against lower-cased text) ---------------
# Cost model: Python's `re` tries an alternation at every position, so a keyword regex over a
# 2 KB view costs ~100 us. Rules therefore test word sets and space-padded phrases first
# (microseconds) and run a regex only when its words are present.
_WORD = re.compile(r"[a-z0-9]+")
_LANGS = frozenset(
    "english french german spanish italian portuguese dutch russian chinese mandarin cantonese "
    "japanese korean arabic hindi bengali urdu turkish polish swedish norwegian danish finnish "
    "greek hebrew vietnamese thai indonesian malay persian farsi czech romanian hungarian "
    "ukrainian latin swahili tagalog".split()
)
_SAY_VERBS = tuple(f" {w} " for w in "say express render put rewrite convert turn".split())
_QUOTED_FOREIGN = re.compile(
    r"[\"“「『«']\s*[\u0370-\u03ff\u0400-\u04ff\u0590-\u06ff\u0900-\u0dff"
    r"\u0e00-\u0eff\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]"
)
# An imperative verb counts at a line/sentence start or after one of these lead-ins.
_LEAD_INS = tuple(" " + w for w in ("please", "kindly", "can you", "could you", "would you", "will you",
                                     "help me", "you to", "now", "then", "and", "also"))
_TRANSLATE_VERB = re.compile(r"translat(?:e\b|ion (?:of|into|to|from)\b)")
_SUMMARIZE_WORDS = frozenset("summarize summarise summary summarization tl tldr recap condense shorten "
                             "synopsis gist sum boil abstract".split())
_SUMMARIZE_VERB = re.compile(r"(?:summari[sz]e|sum (?:it |this |that )?up|recap|condense|shorten|boil down)\b")
_SUMMARY_NOUN = re.compile(
    r"\b(?:give|write|provide|make|produce|create|generate)\b[^.?!\n]{0,30}"
    r"\b(?:summary|synopsis|abstract|recap|tl;?dr|gist)\b|\btl;?\s?dr\b"
)
_SOURCE_LEADS = frozenset("following given presented above below provided attached enclosed pasted this these".split())
_SOURCE_NOUNS = frozenset(
    "text texts article articles passage passages paragraph paragraphs sentence sentences review "
    "reviews document documents email emails data record records report reports transcript "
    "transcripts story stories excerpt excerpts content information statement statements list "
    "table news message messages conversation conversations dialogue comments comment tweet tweets "
    "post posts description descriptions essay essays letter letters snippet snippets poem poems "
    "abstract abstracts notes paper chapter code script program function snippet log logs output".split()
)
_SOURCE_REF = re.compile(
    r"\b(?:following|given|presented|above|below|provided|attached|enclosed|pasted|this|these)\s+"
    r"(?:[\w-]+\s+){0,2}?(?:" + "|".join(sorted(_SOURCE_NOUNS)) + r")\b"
)
_CONTEXT_LINE = re.compile(  # search "\n" + text: a literal first character makes `re` fast
    r"\n[ \t]*(?:context|document|documents|passage|source|sources|background|references?|"
    r"search results?|retrieved(?: \w+)?|knowledge)[ \t]*(?:\[\d+\])?[ \t]*:"
)
_CONTEXT_PHRASE_LEADS = ("based on ", "according to ", "using the ", "given the ", "answer the question")
_CONTEXT_PHRASE = re.compile(
    r"\b(?:based on|according to|using|given) (?:only )?(?:the|this|these) (?:above |following |"
    r"provided |given |retrieved )?(?:context|passages?|documents?|articles?|text|sources|search "
    r"results|information)\b|\banswer the questions? (?:based on|using|from|about)"
)
_CODE_SUBSTRINGS = ("```", "#include", "console.log(", "print(", "System.out.", "=> {", "=>{", "){", ") {")
_CODE_LINE = re.compile(  # case-sensitive, on the original view: a line that starts like code
    r"\n[ \t]*(?:def \w+\s*\(|class \w+\s*[:(]|import \w+|from [\w.]+ import |public (?:static |class )|"
    r"function\s*\w*\s*\(|(?:const|let|var) \w+\s*=|SELECT [\w*]|CREATE TABLE )"
)
_CODE_VERBS = frozenset("write implement develop create code build debug fix refactor optimize optimise "
                        "complete port convert".split())
_CODE_TASK_NOUNS = frozenset("function functions program algorithm code snippet api endpoint query "
                             "website webpage page regex module cli method class".split())
_CODE_TASK = re.compile(
    r"\b(?:" + "|".join(sorted(_CODE_VERBS)) + r")\b[^.?!\n]{0,60}\b(?:function|program|class|method|"
    r"algorithm|code|snippet|api|endpoint|query|website|web ?page|web app|unit tests?|regex|"
    r"data structure|module|cli)\b"
)
_PROG_LANGS = frozenset("python javascript typescript java golang rust kotlin swift php ruby scala haskell "
                        "perl matlab sql html css bash powershell numpy pandas react django flask".split())
_CODE_NOUNS = frozenset("program code script function class method snippet query website webpage syntax "
                        "compiler compile error bug library module implementation".split())
_CODE_PHRASES = (" time complexity ", " space complexity ", " big o ", " o 1 ", " o n ", " o log n ", " o n log n ",
                 " o n 2 ", " linked list ",
                 " binary tree ", " binary search tree ", " hash map ", " hashmap ", " hash table ",
                 " stack trace ", " traceback ", " segfault ", " syntax error ", " compile error ",
                 " recursive function ", " unit test ", " unit tests ", " pull request ", " git commit ")
_EXTRACT_WORDS = frozenset("extract identify list find pull parse classify categorize categorise label tag "
                           "rate score evaluate count detect determine pick select sort rank annotate".split())
_EXTRACT_VERB = re.compile(
    r"(?:extract|identify|list|find|pull out|parse|classify|categori[sz]e|label|tag|rate|score|"
    r"evaluate|count|detect|determine|pick out|select|sort|rank|annotate)\b"
)
_FORMAT_WORDS = frozenset("json jsonl yaml xml csv toml schema tabular".split())
_FORMAT_PHRASES = (" in a table ", " as a table ", " in table ", " markdown table ", " key value pair",
                   " structured output ", " structured data ", " structured format ")
_QUESTION_STARTS = frozenset("who whom whose what when where which why how is are was were do does did can "
                             "could should will would has have question q".split())
_PERSONA_PHRASES = (" act as ", " acting as ", " behave as ", " pretend to be ", " pretend you are ",
                    " pretend you re ", " pretend that you ", " pretend yourself ", " assume the role ",
                    " play the role ", " take on the role ", " adopt the persona ", " the persona of ",
                    " role play ", " roleplay ", " speak like ", " talk like ", " respond as if ",
                    " answer as if ", " stay in character ", " from now on you ")
_IMAGINE_ROLE = re.compile(r" imagine (?:yourself|you are|you re) (?:as )?(?:a|an|the) (?!\w+ing )\w+")
_GREETING_STARTS = (" hi ", " hello ", " hey ", " yo ", " greetings ", " good morning ", " good afternoon ",
                    " good evening ", " how are you ", " how s it going ", " what s up ", " thanks ", " thank you ")
_CREATIVE_VERBS = frozenset("write compose draft create craft construct generate come brainstorm propose "
                            "suggest pen produce invent make develop design".split())
_CREATIVE_NOUNS = (
    "poem|poems|poetry|haiku|limerick|sonnet|verse|verses|lyrics|song|songs|rap|story|stories|tale|"
    "tales|fable|novel|chapter|screenplay|script|play|scene|dialogue|monologue|essay|blog|article|"
    "op-ed|speech|toast|eulogy|letter|email|e-mail|tweet|tweets|caption|slogan|slogans|tagline|"
    "taglines|headline|headlines|title|titles|name|names|jingle|advertisement|ad|pitch|bio|joke|"
    "jokes|character|characters|plot|outline|invitation|announcement"
)
_CREATIVE_NOUN_SET = frozenset(_CREATIVE_NOUNS.split("|"))
_CREATIVE = re.compile(
    r"\b(?:write|compose|draft|create|craft|construct|generate|come up with|brainstorm|propose|suggest|"
    r"pen|produce|invent|make up|develop|design)\b[^.?!\n]{0,80}\b(?:" + _CREATIVE_NOUNS + r")\b"
)
_CREATIVE_STYLE = frozenset("vivid imaginative creative fictional fictitious whimsical poetic imagery "
                            "rhyming rhymes catchy".split())
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# Math expressions, each behind the characters it needs (a regex opening with [a-z] is slow).
_MATH_EXPRS = (
    ("0123456789", re.compile(r"\d\s*[+*/×÷^=<>≤≥]\s*[-\d(a-z]|\d\s+-\s+\d")),  # 3 + 4, 2x = 6, 1/2
    ("^=<>≤≥", re.compile(r"\b[a-z]\s*[\^=<>≤≥]\s*-?\d")),  # x^2, y = 3, x < 10
    ("|", re.compile(r"\|[^|\n]{1,20}\|")),  # |x + 5|
    ("\\", re.compile(r"\\(?:frac|sqrt|int|sum|cdot|times|pi|leq?|geq?)\b")),  # LaTeX
    ("(", re.compile(r"\b(?:sin|cos|tan|log|ln|sqrt|exp)\s*\(")),  # f(x) notation
)
_NUMBER_WORDS = frozenset("two three four five six seven eight nine ten eleven twelve twenty thirty forty "
                          "fifty hundred thousand half twice double triple thrice dozen".split())
_MATH_STRONG = frozenset("equation equations inequality inequalities polynomial polynomials integral "
                         "integrals integrate derivative derivatives differentiate probability theorem "
                         "matrix matrices eigenvalue eigenvalues eigenvector logarithm quadratic arithmetic "
                         "factorial modulo calculus".split())
_MATH_QUANTITY = frozenset("calculate compute solve simplify evaluate percent percentage average total "
                           "altogether each".split())
_MATH_QUANTITY_PHRASES = (" how many ", " how much ", " how long ", " how far ", " how old ", " how fast ",
                          " what is the ", " what was the ", " per hour ", " per minute ", " per day ",
                          " per week ", " per month ", " per year ", " per unit ", " per person ")
_CURRENCY_OR_PERCENT = re.compile(r"[$€£]\s*\d|\d\s*%")
_REASONING_WORDS = frozenset("riddle puzzle puzzles brainteaser logic logical paradox syllogism deduce "
                             "deduction".split())
_REASONING_PHRASES = (" explain your reasoning ", " explain your answer ", " explain your thinking ",
                      " explain your logic ", " reasoning steps ", " step by step ", " think through ",
                      " think it through ", " what could be the reason", " true or false ",
                      " is it possible that ", " is it possible to ", " what comes next ",
                      " next in the sequence ", " brain teaser ")
_HYPOTHETICAL_STARTS = ("imagine", "suppose", "assume", "consider", "let's say", "if you")
_HYPOTHETICAL = re.compile(r"[.!?\n]\s*(?:imagine|suppose|assume|consider|let's say|if you)\b")
_QA_STARTS = _QUESTION_STARTS | frozenset("define explain describe discuss compare contrast outline elaborate "
                                          "tell give provide name list summarize summarise".split())


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
        if self.length >= SOURCE_MIN_CHARS or "```" in self.view or _CONTEXT_LINE.search("\n" + self.view):
            return True
        return bool(self.words & _SOURCE_LEADS and self.words & _SOURCE_NOUNS and _SOURCE_REF.search(self.instr))


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
    words = _WORD.findall(instr)
    return _View(instr=instr, raw_view=raw, view=raw.lower() if n > SHORT_CHARS else instr,
                 tail_line=tail_line, words=frozenset(words), phrase=" " + " ".join(words) + " ", length=n)


def _imperative(s: str, verb: re.Pattern) -> bool:
    """True if ``verb`` occurs in ``s`` at a line/sentence start or right after a lead-in."""
    for m in verb.finditer(s):
        before = s[max(0, m.start() - 16) : m.start()].rstrip(" \t*-#>")
        if not before or before[-1] in "\n.!?:;\"“(" or (" " + before).endswith(_LEAD_INS):
            return True
    return False


# --- the rules (see the module docstring for their order) -------------------------------------
def _is_translation(v: _View) -> bool:
    if "translat" in v.instr and _imperative(v.instr, _TRANSLATE_VERB):
        return True
    langs = v.words & _LANGS
    if not langs:
        return False
    p = v.phrase
    for lang in langs:
        for lead in (" to ", " into "):  # "german to english"
            i = p.find(f" {lang}{lead}")
            if i >= 0 and p[i + len(lang) + len(lead) + 1 :].split(" ", 1)[0] in _LANGS:
                return True
        if f" mean in {lang} " in p or f" means in {lang} " in p:  # "what does ... mean in english"
            return True
        for lead in (" in ", " into "):  # "say ... in french", "rewrite it into spanish"
            i = p.find(f"{lead}{lang} ")
            if i >= 0 and any(verb in p[max(0, i - 60) : i + 1] for verb in _SAY_VERBS):
                return True
    return not v.long and bool(_QUOTED_FOREIGN.search(v.instr))


def _is_summarization(v: _View) -> bool:
    if not v.words & _SUMMARIZE_WORDS or not v.has_source:
        return False
    return _imperative(v.instr, _SUMMARIZE_VERB) or bool(_SUMMARY_NOUN.search(v.instr))


def _is_code(v: _View) -> bool:
    if any(t in v.raw_view for t in _CODE_SUBSTRINGS) or _CODE_LINE.search("\n" + v.raw_view):
        return True
    if v.words & _CODE_VERBS and v.words & _CODE_TASK_NOUNS and _CODE_TASK.search(v.instr):
        return True
    if any(p in v.phrase for p in _CODE_PHRASES):
        return True
    return bool(v.words & _PROG_LANGS or "c++" in v.instr or "c#" in v.instr) and bool(v.words & _CODE_NOUNS)


def _is_extraction(v: _View) -> bool:
    if " named entities " in v.phrase or " key value pair" in v.phrase:
        return v.has_source
    return bool(v.words & _EXTRACT_WORDS) and v.has_source and _imperative(v.instr, _EXTRACT_VERB)


def _is_structured(v: _View) -> bool:
    return bool(v.words & _FORMAT_WORDS) or any(p in v.phrase for p in _FORMAT_PHRASES)


def _has_context_marker(s: str) -> bool:
    if _CONTEXT_LINE.search("\n" + s):
        return True
    return any(p in s for p in _CONTEXT_PHRASE_LEADS) and bool(_CONTEXT_PHRASE.search(s))


def _is_rag(v: _View) -> bool:
    if (_CONTEXT_LINE.search("\n" + v.view) and "?" in v.view) or (_has_context_marker(v.instr) and (v.long or "?" in v.instr)):
        return True
    if v.length < RAG_MIN_CHARS or len(v.tail_line) > INSTR_CHARS:
        return False
    first = _WORD.match(v.tail_line)
    return v.tail_line.endswith("?") or bool(first and first.group() in _QUESTION_STARTS)


def _is_chat(v: _View) -> bool:
    if any(p in v.phrase for p in _PERSONA_PHRASES) or v.phrase.startswith(_GREETING_STARTS):
        return True
    return "imagine" in v.words and bool(_IMAGINE_ROLE.search(v.phrase))


def _is_creative(v: _View) -> bool:
    if v.words & _CREATIVE_STYLE or " in the style of " in v.phrase:
        return True
    return bool(v.words & _CREATIVE_VERBS and v.words & _CREATIVE_NOUN_SET and _CREATIVE.search(v.instr))


def _is_math(v: _View) -> bool:
    for chars, expr in _MATH_EXPRS:
        if any(c in v.instr for c in chars) and expr.search(v.instr):
            return True
    strong = v.words & _MATH_STRONG
    if strong and not (strong == {"equation"} and " chemical equation " in v.phrase) or " prove that " in v.phrase:
        return True
    numbers = len(_NUMBER.findall(v.instr)) + len(v.words & _NUMBER_WORDS)
    if numbers >= 3 and "?" in v.instr:
        return True
    return numbers >= 2 and bool(
        v.words & _MATH_QUANTITY or any(p in v.phrase for p in _MATH_QUANTITY_PHRASES)
        or _CURRENCY_OR_PERCENT.search(v.instr)
    )


def _is_reasoning(v: _View) -> bool:
    if v.words & _REASONING_WORDS or any(p in v.phrase for p in _REASONING_PHRASES):
        return True
    return "?" in v.instr and (v.instr.startswith(_HYPOTHETICAL_STARTS) or bool(_HYPOTHETICAL.search(v.instr)))


def _is_qa(v: _View) -> bool:
    s = v.tail_line if v.long else v.instr
    first = _WORD.match(s)
    return "?" in s or bool(first and first.group() in _QA_STARTS) or " in the field of " in v.phrase[:20]


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
