"""The workload classifier's vocabulary: the word sets, space-padded phrases and regexes that the rules of
cluster/routing/classifier.py match, compiled once at import. Each is matched against the lower-cased
instruction or view of a prompt (the words are defined in the classifier's docstring), except CODE_LINE,
which reads the view as given; the order in which the rules consult them, and what each rule decides,
is the classifier's.
"""

from __future__ import annotations

import re

# --- vocabulary and regexes (compiled once; all matched against lower-cased text) ---------------
# Cost model: Python's `re` tries an alternation at every position, so a keyword regex over a
# 2 KB view costs ~100 us. Rules therefore test word sets and space-padded phrases first
# (microseconds) and run a regex only when its words are present.
WORD = re.compile(r"[a-z0-9]+")
LANGS = frozenset(
    "english french german spanish italian portuguese dutch russian chinese mandarin cantonese "
    "japanese korean arabic hindi bengali urdu turkish polish swedish norwegian danish finnish "
    "greek hebrew vietnamese thai indonesian malay persian farsi czech romanian hungarian "
    "ukrainian latin swahili tagalog".split()
)
SAY_VERBS = tuple(f" {w} " for w in "say express render put rewrite convert turn".split())
QUOTED_FOREIGN = re.compile(
    r"[\"“「『«']\s*[\u0370-\u03ff\u0400-\u04ff\u0590-\u06ff\u0900-\u0dff"
    r"\u0e00-\u0eff\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]"
)
# An imperative verb counts at a line/sentence start or after one of these lead-ins.
LEAD_INS = tuple(" " + w for w in ("please", "kindly", "can you", "could you", "would you", "will you",
                                     "help me", "you to", "now", "then", "and", "also"))
TRANSLATE_VERB = re.compile(r"translat(?:e\b|ion (?:of|into|to|from)\b)")
SUMMARIZE_WORDS = frozenset("summarize summarise summary summarization tl tldr recap condense shorten "
                             "synopsis gist sum boil abstract".split())
SUMMARIZE_VERB = re.compile(r"(?:summari[sz]e|sum (?:it |this |that )?up|recap|condense|shorten|boil down)\b")
SUMMARY_NOUN = re.compile(
    r"\b(?:give|write|provide|make|produce|create|generate)\b[^.?!\n]{0,30}"
    r"\b(?:summary|synopsis|abstract|recap|tl;?dr|gist)\b|\btl;?\s?dr\b"
)
SOURCE_LEADS = frozenset("following given presented above below provided attached enclosed pasted this these".split())
SOURCE_NOUNS = frozenset(
    "text texts article articles passage passages paragraph paragraphs sentence sentences review "
    "reviews document documents email emails data record records report reports transcript "
    "transcripts story stories excerpt excerpts content information statement statements list "
    "table news message messages conversation conversations dialogue comments comment tweet tweets "
    "post posts description descriptions essay essays letter letters snippet snippets poem poems "
    "abstract abstracts notes paper chapter code script program function snippet log logs output".split()
)
SOURCE_REF = re.compile(
    r"\b(?:following|given|presented|above|below|provided|attached|enclosed|pasted|this|these)\s+"
    r"(?:[\w-]+\s+){0,2}?(?:" + "|".join(sorted(SOURCE_NOUNS)) + r")\b"
)
CONTEXT_LINE = re.compile(  # search "\n" + text: a literal first character makes `re` fast
    r"\n[ \t]*(?:context|document|documents|passage|source|sources|background|references?|"
    r"search results?|retrieved(?: \w+)?|knowledge)[ \t]*(?:\[\d+\])?[ \t]*:"
)
CONTEXT_PHRASE_LEADS = ("based on ", "according to ", "using the ", "given the ", "answer the question")
CONTEXT_PHRASE = re.compile(
    r"\b(?:based on|according to|using|given) (?:only )?(?:the|this|these) (?:above |following |"
    r"provided |given |retrieved )?(?:context|passages?|documents?|articles?|text|sources|search "
    r"results|information)\b|\banswer the questions? (?:based on|using|from|about)"
)
CODE_SUBSTRINGS = ("```", "#include", "console.log(", "print(", "System.out.", "=> {", "=>{", "){", ") {")
CODE_LINE = re.compile(  # case-sensitive, on the original view: a line that starts like code
    r"\n[ \t]*(?:def \w+\s*\(|class \w+\s*[:(]|import \w+|from [\w.]+ import |public (?:static |class )|"
    r"function\s*\w*\s*\(|(?:const|let|var) \w+\s*=|SELECT [\w*]|CREATE TABLE )"
)
CODE_VERBS = frozenset("write implement develop create code build debug fix refactor optimize optimise "
                        "complete port convert".split())
CODE_TASK_NOUNS = frozenset("function functions program algorithm code snippet api endpoint query "
                             "website webpage page regex module cli method class".split())
CODE_TASK = re.compile(
    r"\b(?:" + "|".join(sorted(CODE_VERBS)) + r")\b[^.?!\n]{0,60}\b(?:function|program|class|method|"
    r"algorithm|code|snippet|api|endpoint|query|website|web ?page|web app|unit tests?|regex|"
    r"data structure|module|cli)\b"
)
PROG_LANGS = frozenset("python javascript typescript java golang rust kotlin swift php ruby scala haskell "
                        "perl matlab sql html css bash powershell numpy pandas react django flask".split())
CODE_NOUNS = frozenset("program code script function class method snippet query website webpage syntax "
                        "compiler compile error bug library module implementation".split())
CODE_PHRASES = (" time complexity ", " space complexity ", " big o ", " o 1 ", " o n ", " o log n ", " o n log n ",
                 " o n 2 ", " linked list ",
                 " binary tree ", " binary search tree ", " hash map ", " hashmap ", " hash table ",
                 " stack trace ", " traceback ", " segfault ", " syntax error ", " compile error ",
                 " recursive function ", " unit test ", " unit tests ", " pull request ", " git commit ")
EXTRACT_WORDS = frozenset("extract identify list find pull parse classify categorize categorise label tag "
                           "rate score evaluate count detect determine pick select sort rank annotate".split())
EXTRACT_VERB = re.compile(
    r"(?:extract|identify|list|find|pull out|parse|classify|categori[sz]e|label|tag|rate|score|"
    r"evaluate|count|detect|determine|pick out|select|sort|rank|annotate)\b"
)
FORMAT_WORDS = frozenset("json jsonl yaml xml csv toml schema tabular".split())
FORMAT_PHRASES = (" in a table ", " as a table ", " in table ", " markdown table ", " key value pair",
                   " structured output ", " structured data ", " structured format ")
QUESTION_STARTS = frozenset("who whom whose what when where which why how is are was were do does did can "
                             "could should will would has have question q".split())
PERSONA_PHRASES = (" act as ", " acting as ", " behave as ", " pretend to be ", " pretend you are ",
                    " pretend you re ", " pretend that you ", " pretend yourself ", " assume the role ",
                    " play the role ", " take on the role ", " adopt the persona ", " the persona of ",
                    " role play ", " roleplay ", " speak like ", " talk like ", " respond as if ",
                    " answer as if ", " stay in character ", " from now on you ")
IMAGINE_ROLE = re.compile(r" imagine (?:yourself|you are|you re) (?:as )?(?:a|an|the) (?!\w+ing )\w+")
GREETING_STARTS = (" hi ", " hello ", " hey ", " yo ", " greetings ", " good morning ", " good afternoon ",
                    " good evening ", " how are you ", " how s it going ", " what s up ", " thanks ", " thank you ")
CREATIVE_VERBS = frozenset("write compose draft create craft construct generate come brainstorm propose "
                            "suggest pen produce invent make develop design".split())
CREATIVE_NOUNS = (
    "poem|poems|poetry|haiku|limerick|sonnet|verse|verses|lyrics|song|songs|rap|story|stories|tale|"
    "tales|fable|novel|chapter|screenplay|script|play|scene|dialogue|monologue|essay|blog|article|"
    "op-ed|speech|toast|eulogy|letter|email|e-mail|tweet|tweets|caption|slogan|slogans|tagline|"
    "taglines|headline|headlines|title|titles|name|names|jingle|advertisement|ad|pitch|bio|joke|"
    "jokes|character|characters|plot|outline|invitation|announcement"
)
CREATIVE_NOUN_SET = frozenset(CREATIVE_NOUNS.split("|"))
CREATIVE = re.compile(
    r"\b(?:write|compose|draft|create|craft|construct|generate|come up with|brainstorm|propose|suggest|"
    r"pen|produce|invent|make up|develop|design)\b[^.?!\n]{0,80}\b(?:" + CREATIVE_NOUNS + r")\b"
)
CREATIVE_STYLE = frozenset("vivid imaginative creative fictional fictitious whimsical poetic imagery "
                            "rhyming rhymes catchy".split())
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# Math expressions, each behind the characters it needs (a regex opening with [a-z] is slow).
MATH_EXPRS = (
    ("0123456789", re.compile(r"\d\s*[+*/×÷^=<>≤≥]\s*[-\d(a-z]|\d\s+-\s+\d")),  # 3 + 4, 2x = 6, 1/2
    ("^=<>≤≥", re.compile(r"\b[a-z]\s*[\^=<>≤≥]\s*-?\d")),  # x^2, y = 3, x < 10
    ("|", re.compile(r"\|[^|\n]{1,20}\|")),  # |x + 5|
    ("\\", re.compile(r"\\(?:frac|sqrt|int|sum|cdot|times|pi|leq?|geq?)\b")),  # LaTeX
    ("(", re.compile(r"\b(?:sin|cos|tan|log|ln|sqrt|exp)\s*\(")),  # f(x) notation
)
NUMBER_WORDS = frozenset("two three four five six seven eight nine ten eleven twelve twenty thirty forty "
                          "fifty hundred thousand half twice double triple thrice dozen".split())
MATH_STRONG = frozenset("equation equations inequality inequalities polynomial polynomials integral "
                         "integrals integrate derivative derivatives differentiate probability theorem "
                         "matrix matrices eigenvalue eigenvalues eigenvector logarithm quadratic arithmetic "
                         "factorial modulo calculus".split())
MATH_QUANTITY = frozenset("calculate compute solve simplify evaluate percent percentage average total "
                           "altogether each".split())
MATH_QUANTITY_PHRASES = (" how many ", " how much ", " how long ", " how far ", " how old ", " how fast ",
                          " what is the ", " what was the ", " per hour ", " per minute ", " per day ",
                          " per week ", " per month ", " per year ", " per unit ", " per person ")
CURRENCY_OR_PERCENT = re.compile(r"[$€£]\s*\d|\d\s*%")
REASONING_WORDS = frozenset("riddle puzzle puzzles brainteaser logic logical paradox syllogism deduce "
                             "deduction".split())
REASONING_PHRASES = (" explain your reasoning ", " explain your answer ", " explain your thinking ",
                      " explain your logic ", " reasoning steps ", " step by step ", " think through ",
                      " think it through ", " what could be the reason", " true or false ",
                      " is it possible that ", " is it possible to ", " what comes next ",
                      " next in the sequence ", " brain teaser ")
HYPOTHETICAL_STARTS = ("imagine", "suppose", "assume", "consider", "let's say", "if you")
HYPOTHETICAL = re.compile(r"[.!?\n]\s*(?:imagine|suppose|assume|consider|let's say|if you)\b")
QA_STARTS = QUESTION_STARTS | frozenset("define explain describe discuss compare contrast outline elaborate "
                                          "tell give provide name list summarize summarise".split())
