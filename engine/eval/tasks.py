"""Seeded long-context tasks: passkey, needle-in-a-haystack (single, multi-key,
multi-value), a long document for teacher-forced fidelity, and questions about a
generated Python project (code_def, code_value, code_caller: `code_tasks.py`).
Nothing is downloaded.

Every needle prompt is plain completion (no chat template): instructions, a haystack
with the needle(s), the question, and an answer cue the small model continues
("The pass key is"). The code questions are in the model's chat format. Lengths are
counted in tokens of the model's tokenizer; a prompt never exceeds its target and
falls short of it by at most a sentence (a few constants' lines for code).

Depth d (percent) puts the (first) needle after d% of the haystack's tokens, on
a sentence boundary. Other needles (distractors, extra values) go to random
depths drawn from the sample's own generator.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from ..errors import EngineError
from .code_tasks import CODE_ANSWER_UNITS, CODE_TASKS, make_code, score_code

RETRIEVAL_TASKS = ("passkey", "niah", "niah_multikey", "niah_multivalue")   # digits answers
DEFAULT_TASKS = RETRIEVAL_TASKS + ("fidelity",)      # a run without --tasks
TASKS = DEFAULT_TASKS + CODE_TASKS
SCORED_TASKS = RETRIEVAL_TASKS + CODE_TASKS          # answered and marked right or wrong
TASK_GROUPS = {"code": CODE_TASKS}                   # --tasks code: all three kinds
N_DISTRACTORS = 3        # niah_multikey: needles with other keys
N_VALUES = 4             # niah_multivalue: numbers for the asked key


class TokenCounter(Protocol):
    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]: ...


@dataclass
class Sample:
    """One generated prompt and what a correct answer contains."""
    task: str
    target_tokens: int                 # requested prompt length
    index: int                         # sample number within (task, length)
    depth: float                       # requested needle depth, percent of the haystack
    seed: int
    prompt: str
    ids: list[int]                     # prompt token ids as the model sees them
    expected: list[str] = field(default_factory=list)   # every string the answer must contain
    key: str | None = None             # the asked word (niah*)
    needle_token_pos: int | None = None   # token index where the (first) needle starts
    continuation: list[int] = field(default_factory=list)   # fidelity: teacher-forced tokens
    answer_kind: str | None = None     # code tasks: path | number | string | identifier
    distractors: list[str] = field(default_factory=list)    # code_caller: names a right answer does not give

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def depth_actual(self) -> float | None:
        """Needle start as a percentage of the prompt."""
        if self.needle_token_pos is None:
            return None
        return 100.0 * self.needle_token_pos / max(len(self.ids), 1)


# -- filler -------------------------------------------------------------------------
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_NAMES = ("Alice", "Bruno", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hector", "Ingrid", "Jonas",
          "Kenji", "Laura", "Mateo", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Samuel", "Tara",
          "Ulrich", "Vera", "Walter", "Yasmin", "Zoe", "the baker", "the old captain", "my neighbour",
          "the new teacher", "a young painter", "the mayor", "our guide")
_PLACES = ("the harbour", "the market square", "the library", "the mountain village", "the train station",
           "the river bank", "the old mill", "the botanical garden", "the museum", "the bakery on the corner",
           "the school yard", "the lighthouse", "the orchard", "the workshop", "the quiet beach",
           "the concert hall", "the farm", "the bridge", "the forest path", "the town hall")
_THINGS = ("a wooden boat", "a basket of apples", "an old map", "a blue umbrella", "a letter", "a violin",
           "a loaf of bread", "a stack of books", "a bicycle", "a pair of boots", "a clay pot", "a kite",
           "a lantern", "a notebook", "a wool scarf", "a jar of honey", "a painting of the sea",
           "a broken clock", "a bag of seeds", "a silver key")
_ADJ = ("quiet", "busy", "cold", "bright", "windy", "pleasant", "grey", "warm", "crowded", "peaceful",
        "rainy", "calm", "noisy", "sunny", "misty", "long")
_TIMES = ("In the morning", "Later that day", "On Sunday", "After lunch", "Every spring", "Last winter",
          "Before dawn", "In the evening", "During the festival", "Once a week", "At noon", "In autumn")
_VERBS = ("carried", "found", "repaired", "painted", "sold", "borrowed", "described", "forgot",
          "brought", "cleaned", "wrapped", "admired")
_TOPICS = ("the weather", "the price of flour", "an old song", "the harvest", "a long journey",
           "the history of the town", "a recipe for soup", "the stars", "a famous poem", "the tides",
           "their childhood", "a strange dream")
_TEMPLATES = (
    "{time}, {name} walked to {place} and {verb} {thing}.",
    "{name} spoke with {name2} about {topic} near {place}.",
    "The day was {adj}, so {name} stayed at {place} for a while.",
    "{time}, the road to {place} was {adj} and full of people.",
    "{name} {verb} {thing} and gave it to {name2}.",
    "People say that {place} is {adj} at this time of year.",
    "{name} wrote a short note about {topic} and left it at {place}.",
    "It was a {adj} afternoon when {name} met {name2} at {place}.",
    "{time}, {name} told a story about {topic}.",
    "Nobody knew why {name} {verb} {thing} at {place}.",
    "{name2} remembered {topic} while walking past {place}.",
    "{time}, {name} and {name2} shared {thing} at {place}.",
)

# Keys of the magic numbers: never words of the filler vocabulary above.
KEY_WORDS = ("ambitious-lobster", "silent-meteor", "crimson-walrus", "frozen-tulip", "gentle-volcano",
             "hollow-banjo", "jagged-pelican", "lucky-marble", "nimble-cactus", "olive-thunder",
             "polite-glacier", "rapid-pumpkin", "scarlet-otter", "tidy-comet", "velvet-anchor",
             "wicked-noodle", "zesty-lantern", "brave-kettle", "clumsy-falcon", "dusty-saxophone",
             "eager-mammoth", "fuzzy-compass", "giant-sparrow", "humble-rocket", "icy-parsnip",
             "jolly-vulture", "mellow-cobra", "noisy-igloo", "proud-teapot", "quirky-badger")


def filler_sentence(rng: np.random.Generator) -> str:
    """One natural-looking sentence from the templates and vocabulary (no digits)."""
    pick = lambda seq: seq[int(rng.integers(len(seq)))]   # noqa: E731
    name = pick(_NAMES)
    name2 = pick([n for n in _NAMES if n != name])
    s = pick(_TEMPLATES).format(time=pick(_TIMES), name=name, name2=name2, place=pick(_PLACES),
                                verb=pick(_VERBS), thing=pick(_THINGS), topic=pick(_TOPICS), adj=pick(_ADJ))
    return s[0].upper() + s[1:]


# -- building prompts ---------------------------------------------------------------
def _count(tok: TokenCounter, text: str) -> int:
    return len(tok.encode(text, add_bos=False, special=False))


def _haystack(tok: TokenCounter, sentences, budget: int) -> tuple[list[str], list[int]]:
    """Filler sentences (from the iterator) totalling at most `budget` tokens,
    and the token count of each (as ' ' + sentence)."""
    out, counts, total = [], [], 0
    for s in sentences:
        n = _count(tok, " " + s)
        if total + n > budget:
            break
        out.append(s)
        counts.append(n)
        total += n
    return out, counts


def _slot(counts: Sequence[int], depth: float) -> int:
    """Sentence boundary (index into the haystack) nearest to depth% of its tokens."""
    cum = np.concatenate([[0], np.cumsum(counts)])                 # [n + 1] token offset of each boundary
    return int(np.argmin(np.abs(cum - depth / 100.0 * cum[-1])))


def _assemble(tok: TokenCounter, head: str, sentences: list[str], counts: list[int],
              needles: list[tuple[float, str]], question: str, target: int) -> tuple[str, list[int], int]:
    """Insert needles (depth%, text) into the haystack, join, tokenize. Drops trailing
    filler until the prompt fits `target`. Returns (prompt, ids, first needle's token index)."""
    sentences, counts = list(sentences), list(counts)
    while True:
        slots = [_slot(counts, d) for d, _ in needles]
        body = list(sentences)
        # insert from the back so earlier slots stay valid; stable for equal slots
        for order in sorted(range(len(needles)), key=lambda i: (slots[i], i), reverse=True):
            body.insert(slots[order], needles[order][1])
        first = needles[0][1]
        text = head + " ".join(body) + question
        ids = tok.encode(text)
        if len(ids) <= target or not sentences:
            break
        sentences.pop()
        counts.pop()
    char = text.index(first)
    needle_pos = len(tok.encode(text[:char].rstrip(" ")))
    return text, ids, needle_pos


def _sample_rng(seed: int, task: str, target: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(task.encode()), target, index])


def _fixed_cost(tok: TokenCounter, head: str, question: str, needles: Sequence[str]) -> int:
    return len(tok.encode(head + question)) + sum(_count(tok, " " + n) for n in needles) + 2


def _filler_stream(rng: np.random.Generator):
    while True:
        yield filler_sentence(rng)


def _passkey_stream():
    parts = [p.rstrip(".") + "." for p in PASSKEY_FILLER.split(". ")]
    while True:
        yield from parts


def _number(rng: np.random.Generator, digits: int, taken: set) -> str:
    while True:
        v = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        if v not in taken:
            taken.add(v)
            return v


def make_passkey(tok: TokenCounter, target: int, depth: float, seed: int, index: int) -> Sample:
    rng = _sample_rng(seed, "passkey", target, index)
    key = _number(rng, 5, set())
    head = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n\n")
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "\n\nWhat is the pass key? The pass key is"
    budget = target - _fixed_cost(tok, head, question, [needle])
    body, counts = _haystack(tok, _passkey_stream(), budget)
    prompt, ids, pos = _assemble(tok, head, body, counts, [(depth, needle)], question, target)
    return Sample("passkey", target, index, depth, seed, prompt, ids, [key], None, pos)


_NIAH_HEAD = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n\n")


def _niah_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def make_niah(tok: TokenCounter, target: int, depth: float, seed: int, index: int,
              task: str = "niah") -> Sample:
    """task: niah (one needle), niah_multikey (the asked needle plus distractor keys),
    niah_multivalue (several numbers for the asked key, all asked)."""
    rng = _sample_rng(seed, task, target, index)
    words = [str(w) for w in rng.permutation(KEY_WORDS)]
    key = words[0]
    taken: set = set()
    if task == "niah":
        values = [_number(rng, 7, taken)]
        needles = [(depth, _niah_needle(key, values[0]))]
    elif task == "niah_multikey":
        values = [_number(rng, 7, taken)]
        needles = [(depth, _niah_needle(key, values[0]))]
        needles += [(float(rng.uniform(0, 100)), _niah_needle(w, _number(rng, 7, taken)))
                    for w in words[1:1 + N_DISTRACTORS]]
    elif task == "niah_multivalue":
        values = [_number(rng, 7, taken) for _ in range(N_VALUES)]
        needles = [(depth, _niah_needle(key, values[0]))]
        needles += [(float(rng.uniform(0, 100)), _niah_needle(key, v)) for v in values[1:]]
    else:
        raise EngineError(f"unknown needle task {task!r}")
    if task == "niah_multivalue":
        question = (f"\n\nWhat are all the special magic numbers for {key} mentioned in the text? "
                    f"The special magic numbers for {key} are")
    else:
        question = (f"\n\nWhat is the special magic number for {key} mentioned in the text? "
                    f"The special magic number for {key} is")
    budget = target - _fixed_cost(tok, _NIAH_HEAD, question, [n for _, n in needles])
    body, counts = _haystack(tok, _filler_stream(rng), budget)
    prompt, ids, pos = _assemble(tok, _NIAH_HEAD, body, counts, needles, question, target)
    return Sample(task, target, index, depth, seed, prompt, ids, values, key, pos)


@dataclass
class FollowUp:
    """A two-question conversation about one document: `first` asks for key A's number
    (a Sample whose answer is the first turn), `turn2` is the answer to it (A's number,
    teacher-forced) followed by the question for key B, whose number is `expected`."""
    first: Sample
    turn2: list[int]                   # token ids after first.ids (no BOS)
    key: str                           # key B
    expected: list[str]                # key B's number
    needle_token_pos: int              # token index of B's needle in first.ids


def make_followup(tok: TokenCounter, target: int, depth: float, seed: int, index: int) -> FollowUp:
    """Two needles with different keys, A at `depth` and B half a document away from it;
    the prompt asks for A, the follow-up for B (the rows B needs are the ones a first
    question's eviction is likely to have dropped)."""
    rng = _sample_rng(seed, "followup", target, index)
    words = [str(w) for w in rng.permutation(KEY_WORDS)]
    key_a, key_b = words[0], words[1]
    taken: set = set()
    value_a, value_b = _number(rng, 7, taken), _number(rng, 7, taken)
    needle_b = _niah_needle(key_b, value_b)
    needles = [(depth, _niah_needle(key_a, value_a)), ((depth + 50.0) % 100.0, needle_b)]
    question = (f"\n\nWhat is the special magic number for {key_a} mentioned in the text? "
                f"The special magic number for {key_a} is")
    budget = target - _fixed_cost(tok, _NIAH_HEAD, question, [n for _, n in needles])
    body, counts = _haystack(tok, _filler_stream(rng), budget)
    prompt, ids, pos = _assemble(tok, _NIAH_HEAD, body, counts, needles, question, target)
    first = Sample("niah", target, index, depth, seed, prompt, ids, [value_a], key_a, pos)
    turn2 = tok.encode(f" {value_a}.\n\nWhat is the special magic number for {key_b} mentioned in the text? "
                       f"The special magic number for {key_b} is", add_bos=False, special=False)
    pos_b = len(tok.encode(prompt[:prompt.index(needle_b)].rstrip(" ")))
    return FollowUp(first, turn2, key_b, [value_b], pos_b)


def make_fidelity(tok: TokenCounter, target: int, seed: int, index: int, continuation: int) -> Sample:
    """A long document of varied filler; the next `continuation` tokens of the same
    document are teacher-forced after the prompt."""
    rng = _sample_rng(seed, "fidelity", target, index)
    head = "A collection of notes about life in a small town.\n\n"
    body, _ = _haystack(tok, _filler_stream(rng), target + continuation + 64)
    ids = tok.encode(head + " ".join(body))
    cont = ids[target:target + continuation]
    ids = ids[:target]
    prompt = head + " ".join(body)     # full document; `ids` is its first `target` tokens
    return Sample("fidelity", target, index, 50.0, seed, prompt, ids, [], None, None, list(cont))


def make_sample(task: str, tok: TokenCounter, target: int, depth: float, seed: int, index: int,
                continuation: int = 64) -> Sample:
    """One sample of `task` with a prompt of at most `target` tokens."""
    if task == "passkey":
        return make_passkey(tok, target, depth, seed, index)
    if task in ("niah", "niah_multikey", "niah_multivalue"):
        return make_niah(tok, target, depth, seed, index, task)
    if task == "fidelity":
        return make_fidelity(tok, target, seed, index, continuation)
    if task in CODE_TASKS:
        return make_code(tok, target, depth, seed, index, task)
    raise EngineError(f"unknown task {task!r} (choose from {', '.join(TASKS)})")


def sample_depth(depths: Sequence[float], index: int, n_samples: int) -> float:
    """Depth of sample `index` of `n_samples`: round robin over `depths` when there are
    at least as many samples as depths, otherwise evenly spread across them."""
    n = len(depths)
    if n_samples >= n:
        return float(depths[index % n])
    return float(depths[int((index + 0.5) * n / n_samples)])


# -- scoring ------------------------------------------------------------------------
_DIGIT_RUN = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+")     # 1,234,567 is one number
_OPEN_RUN = re.compile(r"[\d,]*\d,?\Z")                           # may still grow


def numbers_in(text: str, min_digits: int = 1) -> list[str]:
    """The numbers of `text`, in order: maximal digit runs, thousands commas dropped
    ("1,234,567" -> "1234567"), those shorter than `min_digits` left out (so a list
    marker "1." is not taken for a 7-digit answer)."""
    runs = (m.group().replace(",", "") for m in _DIGIT_RUN.finditer(text))
    return [r for r in runs if len(r) >= min_digits]


def answer_complete(text: str, expected: Sequence[str]) -> bool:
    """Whether `text` already holds as many finished numbers (closed by something that
    cannot continue them) of the expected answers' length as answers are expected."""
    closed = _OPEN_RUN.sub("", text)
    return len(numbers_in(closed, min(map(len, expected)))) >= len(expected)


def answer_units(task: str) -> int:
    """Answer tokens of `task` in units of --max-new-tokens."""
    return N_VALUES if task == "niah_multivalue" else CODE_ANSWER_UNITS if task in CODE_TASKS else 1


def score(sample: Sample, generated: str) -> float:
    """Fraction of expected numbers found among the digit runs of the answer; code
    tasks: 1.0 for exactly the expected answer (code_tasks.score_code), else 0.0."""
    if sample.task in CODE_TASKS:
        return score_code(sample.answer_kind or "", sample.expected[0], generated, sample.distractors)
    found = set(numbers_in(generated, min(map(len, sample.expected), default=1)))
    return sum(v in found for v in sample.expected) / max(len(sample.expected), 1)
