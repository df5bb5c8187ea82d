"""Plain-language code-writing requests made from a corpus function's docstring.

A user asks "Write a Python function that reverses a string.", not "Write a Python
function `f(s: str) -> str`." with the docstring pasted below it. The first model was
trained only on the second form and answered the first by copying the request into a
`def` line; these phrasings turn the docstring's first sentence (PEP 257's imperative
"Return the ...", or "Returns the ...") into the requests people type, so the model
learns to name and write the function itself.

    summary(doc)          -> the docstring's first sentence, one line, or None
    verb_forms(sentence)  -> (third person "returns the ...", imperative "return the ...")
                             or None when it does not start with a verb
    request(name, sig, sentence, style) -> the user message of phrasing `style`
"""
from __future__ import annotations

import re

# imperative verbs docstrings start with (PEP 257's "Return the ..."), in the base form;
# a sentence starting with any other word ("The ...", "Helper for ...", "TIFF ...") is
# asked for only in the phrasings that need no verb
VERBS = frozenset("""
    accept add allocate append apply assert attach bind build calculate call capitalize change
    check clean clear clip close coerce collect combine compare compile compute concatenate
    configure connect construct convert copy count create decode decorate decrement define
    delete deserialize detect determine disable display download dump emit enable encode
    ensure escape evaluate execute exit expand extract fetch fill filter find flatten flush
    format generate get group guess handle hash identify import increment initialize insert
    inspect install interpret invoke iterate join keep limit list load lookup lower make map
    mark match measure merge mock move normalize notify open override pack pad parse
    partition patch peek perform pick pop post prepare print process produce provide push
    put query queue quote raise read receive record redirect reduce refresh register release
    remap remove rename render repeat replace report request require reset resize resolve
    restore retrieve return reverse rotate round run sanitize save scale scan schedule
    search select send serialize set shift show shuffle simulate skip sleep slice sniff sort
    split squeeze start stop store strip submit substitute subtract sum swap take tell test
    toggle tokenize trace transform translate trim truncate try turn unescape unpack unquote
    unregister unset unwrap update upload upper use validate verify visit wait walk wrap
    write yield zip""".split())

_SENTENCE = re.compile(r"^(.+?[.!?])(?:\s|$)", re.DOTALL)


def summary(doc: str) -> str | None:
    """The first sentence of a docstring's first paragraph, on one line (None when it is
    no plain sentence: reST fields, doctest prompts, too short or too long)."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = _SENTENCE.match(para)
    s = m.group(1) if m else para
    if not 12 <= len(s) <= 160 or not s[0].isalpha() or ">>>" in s or "::" in s:
        return None
    return s.rstrip(".!?").rstrip()


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if len(verb) > 2 and verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _imperative(verb: str) -> str:
    if verb.endswith("ies") and len(verb) > 4:
        return verb[:-3] + "y"
    if verb.endswith(("sses", "shes", "ches", "xes", "zes", "oes")):
        return verb[:-2]
    return verb[:-1]


def verb_forms(sentence: str) -> tuple[str, str] | None:
    """("returns the sum of x", "return the sum of x") from either "Return the sum of x"
    or "Returns the sum of x"; None when the first word is none of VERBS."""
    first, _, rest = sentence.partition(" ")
    low = first.lower()
    if not rest or not first.isalpha() or first != low.capitalize():
        return None
    if low in VERBS:
        imp = low
    elif low.endswith("s") and _imperative(low) in VERBS:
        imp = _imperative(low)
    else:
        return None
    return f"{_third_person(imp)} {rest}", f"{imp} {rest}"


# each phrasing: (template, needs verb forms); {third} / {imp}: the verb phrases,
# {sentence}: the docstring sentence, {name} / {sig}: the corpus function's (the
# signature-and-docstring form is instruct.py's own style)
PHRASINGS: tuple[tuple[str, bool], ...] = (
    ("Write a Python function that {third}.", True),
    ("Write a Python function to {imp}.", True),
    ("Write a function that {third}.", True),
    ("Can you write a Python function that {third}?", True),
    ("Write a Python function named `{name}` that {third}.", True),
    ("Implement `{name}` in Python. It should {imp}.", True),
    ("Python: {imp}.", True),
    ("Create a function `{name}`: {sentence}.", False),
)


def request(name: str, sig: str, sentence: str, style: int) -> str | None:
    """The user message of phrasing `style` (an index into PHRASINGS, taken modulo its
    length); None when the phrasing needs a verb and the sentence has none."""
    template, needs_verb = PHRASINGS[style % len(PHRASINGS)]
    forms = verb_forms(sentence)
    if needs_verb and forms is None:
        return None
    third, imp = forms or ("", "")
    return template.format(third=third, imp=imp, sentence=sentence, name=name, sig=sig)
