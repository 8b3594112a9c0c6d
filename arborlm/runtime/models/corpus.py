"""Deterministic training text for the built-in byte-level BPE tokenizers.

`training_corpus(n_lines)` yields lines of English-like prose (a fixed word list plus
syllable-built pseudo-words, so a 32k vocabulary has enough distinct words to merge), code-like
and JSON-like snippets, numbers, and multi-byte UTF-8 text (accented words, CJK, emoji) so the
trained vocabulary holds multi-byte tokens. The output depends only on `n_lines`, and a shorter
corpus is a prefix of a longer one.

This module is not a data set: the text means nothing. Nothing here reads files or the network.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from itertools import accumulate

SEED = 20240601

WORDS = (
    "the of and to in is was for on that with as by at from it be this are have an which or "
    "not but had has were one all their they we there been can more when who will would what "
    "time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect use class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data "
    "picture practice piece land product doctor wall patient worker news test movie north love "
    "support technology step baby computer type attention film tree source organization hair "
    "window evidence population truth song energy memory token cache request server grammar "
    "say make go know take see come think look want give find tell ask seem feel try leave "
    "call keep let begin help talk turn start run move live believe hold bring happen write "
    "provide sit stand lose pay meet include continue set learn lead understand watch follow "
    "stop create speak read allow add spend grow open walk win offer remember consider appear "
    "buy wait serve die send expect build stay fall cut reach kill remain suggest raise pass "
    "good new first last long great little own other old big high different small large next "
    "early young important few public bad same able quick slow bright dark simple clear"
).split()

ACCENTED = (
    "café naïve résumé façade jalapeño crème brûlée über straße mañana señor garçon déjà vu "
    "élève hôtel fiancée piñata smörgåsbord Zürich München São Paulo Kraków Ångström"
).split()

CJK = ("你好世界", "数据", "模型", "语言", "缓存", "東京", "日本語", "こんにちは", "ありがとう",
       "한국어", "안녕하세요", "서버", "Привет", "мир", "γειά σου", "κόσμε", "مرحبا", "שלום")

EMOJI = ("😀", "🚀", "✨", "🔥", "👍", "🎉", "🌍", "💡", "✅", "❤️", "🙂", "📦")

ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
          "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y")
CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")

CODE_KEYWORDS = ("def", "return", "class", "import", "from", "for", "while", "if", "else",
                 "elif", "try", "except", "with", "lambda", "yield", "async", "await", "const",
                 "let", "function", "fn", "pub", "struct", "impl", "match", "None", "True")


def _pseudo_lexicon(rng: random.Random, size: int) -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < size:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                    for _ in range(syllables))
        if len(w) > 2 and w not in seen:
            seen.add(w)
            words.append(w)
    return words


class _Generator:
    """Draws words with a Zipf-like skew so frequent words merge first, as in real text."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lexicon = list(WORDS) + _pseudo_lexicon(self.rng, 40000)
        self.cum_weights = list(accumulate(1.0 / (rank + 10) for rank in range(len(self.lexicon))))

    def words(self, n: int) -> list[str]:
        return self.rng.choices(self.lexicon, cum_weights=self.cum_weights, k=n)

    def sentence(self) -> str:
        ws = self.words(self.rng.randint(4, 16))
        ws[0] = ws[0].capitalize()
        if self.rng.random() < 0.1:
            ws.insert(self.rng.randrange(len(ws)), self.rng.choice(ACCENTED))
        if self.rng.random() < 0.1:
            ws.append(str(self.rng.randint(0, 10 ** self.rng.randint(1, 6))))
        return " ".join(ws) + self.rng.choice((".", ".", ".", "?", "!", ";", ":"))

    def identifier(self) -> str:
        parts = self.words(self.rng.randint(1, 3))
        style = self.rng.random()
        if style < 0.5:
            return "_".join(parts)
        if style < 0.8:
            return parts[0] + "".join(p.capitalize() for p in parts[1:])
        return "".join(p.capitalize() for p in parts)

    def code(self) -> str:
        name, arg, other = self.identifier(), self.identifier(), self.identifier()
        kw = self.rng.choice(CODE_KEYWORDS)
        n = self.rng.randint(0, 999)
        return self.rng.choice((
            f"def {name}({arg}, {other}=None):\n    return {arg} + {n}\n",
            f"    if {arg} is not None:\n        {name}.append({other}[{n}])\n",
            f"for {arg} in range({n}):\n    {name}[{arg}] = {other}({arg})\n",
            f"const {name} = ({arg}) => {{ return {other}.{kw}({n}); }};\n",
            f"{name} = {{\"{arg}\": {n}, \"{other}\": [{n}, {n + 1}]}}  # {kw}\n",
            f"pub fn {name}(&self, {arg}: usize) -> Option<{other.capitalize()}> {{ None }}\n",
        ))

    def json_snippet(self) -> str:
        keys = self.words(self.rng.randint(1, 5))
        obj: dict[str, object] = {}
        for k in keys:
            r = self.rng.random()
            if r < 0.3:
                obj[k] = self.rng.randint(-1000, 100000)
            elif r < 0.5:
                obj[k] = round(self.rng.uniform(-100, 100), self.rng.randint(1, 4))
            elif r < 0.6:
                obj[k] = self.rng.choice((True, False, None))
            elif r < 0.8:
                obj[k] = " ".join(self.words(self.rng.randint(1, 4)))
            else:
                obj[k] = self.words(self.rng.randint(0, 3))
        indent = self.rng.choice((None, None, 2, 4))
        return json.dumps(obj, indent=indent, ensure_ascii=self.rng.random() < 0.3)

    def multilingual(self) -> str:
        parts = [self.rng.choice(CJK) for _ in range(self.rng.randint(1, 4))]
        parts += [self.rng.choice(EMOJI)] * self.rng.randint(0, 2)
        parts.append(self.rng.choice(ACCENTED))
        self.rng.shuffle(parts)
        return " ".join(parts)

    def line(self) -> str:
        r = self.rng.random()
        if r < 0.55:
            return " ".join(self.sentence() for _ in range(self.rng.randint(1, 4)))
        if r < 0.75:
            return self.code()
        if r < 0.9:
            return self.json_snippet()
        return self.multilingual()


def training_corpus(n_lines: int) -> Iterator[str]:
    """Yield `n_lines` deterministic lines of mixed text (see the module docstring)."""
    gen = _Generator(SEED)
    for _ in range(n_lines):
        yield gen.line()
