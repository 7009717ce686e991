"""Task generators of `engine eval`: seeded, needles where asked, lengths on target;
answer parsing; the code questions' answers checked against the parsed code; policy names."""
import ast
import re

import numpy as np
import pytest

from engine.errors import EngineError
from engine.eval import tasks as T
from engine.eval.policies import default_policies, parse_policy


class WordTokenizer:
    """One token per word or punctuation mark: a stand-in with the encode() signature."""

    def encode(self, text, add_bos=None, special=True):
        return [hash(w) % 50000 for w in re.findall(r"\w+|[^\w\s]", text)]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages) + "<assistant>\n"


@pytest.fixture(scope="module")
def real_tok():
    from engine.model_path import smollm2_model_path
    from engine.tokenizer import Tokenizer
    path = smollm2_model_path()
    if path is None:
        pytest.skip("smollm2 not installed (make setup)")
    return Tokenizer.from_gguf(path)


@pytest.mark.parametrize("task", T.TASKS)
def test_seeded_and_deterministic(task):
    tok = WordTokenizer()
    a = T.make_sample(task, tok, 600, 40, seed=3, index=1)
    b = T.make_sample(task, tok, 600, 40, seed=3, index=1)
    assert (a.prompt, a.ids, a.expected, a.key, a.continuation) == (b.prompt, b.ids, b.expected, b.key, b.continuation)
    c = T.make_sample(task, tok, 600, 40, seed=3, index=2)
    d = T.make_sample(task, tok, 600, 40, seed=4, index=1)
    assert c.prompt != a.prompt and d.prompt != a.prompt


@pytest.mark.parametrize("task", T.RETRIEVAL_TASKS + T.CODE_TASKS)
@pytest.mark.parametrize("depth", [0, 10, 50, 90, 100])
def test_needle_at_requested_depth(task, depth):
    tok = WordTokenizer()
    s = T.make_sample(task, tok, 2000, depth, seed=0, index=0)
    for v in s.expected:
        assert v in s.prompt
    # depth is measured over the haystack; head and question shift it by a few percent
    # (code: the chat template, the instructions and the first file's head come first)
    assert abs(s.depth_actual - depth) < (8.0 if task in T.CODE_TASKS else 5.0), (s.depth_actual, depth)
    if task in T.CODE_TASKS:
        return
    if task == "passkey":
        assert f"The pass key is {s.expected[0]}." in s.prompt
        assert s.prompt.endswith("The pass key is")
    else:
        assert f"One of the special magic numbers for {s.key} is: {s.expected[0]}." in s.prompt
        assert s.prompt.rstrip().endswith(s.key + (" are" if task == "niah_multivalue" else " is"))


def test_needle_variants():
    tok = WordTokenizer()
    mk = T.make_sample("niah_multikey", tok, 1500, 50, seed=0, index=0)
    keys = re.findall(r"special magic numbers for (\S+) is: (\d{7})\.", mk.prompt)
    assert len(keys) == 1 + T.N_DISTRACTORS and len({k for k, _ in keys}) == len(keys)
    assert (mk.key, mk.expected[0]) in keys
    mv = T.make_sample("niah_multivalue", tok, 1500, 50, seed=0, index=0)
    vals = re.findall(rf"special magic numbers for {mv.key} is: (\d{{7}})\.", mv.prompt)
    assert sorted(vals) == sorted(mv.expected) and len(set(vals)) == T.N_VALUES


def test_filler_is_varied_and_free_of_digits():
    s = T.make_sample("niah", WordTokenizer(), 3000, 50, seed=0, index=0)
    haystack = s.prompt.replace(f"One of the special magic numbers for {s.key} is: {s.expected[0]}.", "")
    assert not re.search(r"\d", haystack)
    sentences = re.split(r"(?<=\.) ", haystack)
    assert len(set(sentences)) > 0.8 * len(sentences)
    assert not any(k in haystack for k in T.KEY_WORDS if k != s.key)


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("target", [256, 1024, 4096])
def test_token_length_close_to_target(real_tok, task, target):
    s = T.make_sample(task, real_tok, target, 50, seed=0, index=0)
    assert s.ids == real_tok.encode(s.prompt) or task == "fidelity"
    assert target - 30 <= s.n_tokens <= target
    if task == "fidelity":
        assert s.n_tokens == target and len(s.continuation) == 64


@pytest.mark.parametrize("depth", [0, 30, 80])
def test_followup_asks_for_two_keys_half_a_document_apart(real_tok, depth):
    """Turn 1 asks for key A (its number the first answer), turn 2 answers A and asks
    for key B, whose needle sits about half the prompt away from A's."""
    fu = T.make_followup(real_tok, 2000, depth, seed=5, index=3)
    a, b = fu.first.key, fu.key
    assert a != b and fu.first.expected != fu.expected and len(fu.first.ids) <= 2000
    assert f"special magic numbers for {a} is: {fu.first.expected[0]}." in fu.first.prompt
    assert f"special magic numbers for {b} is: {fu.expected[0]}." in fu.first.prompt
    assert fu.first.prompt.endswith(f"The special magic number for {a} is")
    text = real_tok.decode(fu.turn2)
    assert text.startswith(f" {fu.first.expected[0]}.") and text.endswith(f"for {b} is")
    gap = abs(fu.needle_token_pos - fu.first.needle_token_pos) / fu.first.n_tokens
    assert 0.4 < gap < 0.6
    again = T.make_followup(real_tok, 2000, depth, seed=5, index=3)
    assert (again.first.ids, again.turn2) == (fu.first.ids, fu.turn2)


def _files(sample) -> dict[str, ast.Module]:
    """The generated project of a code question: path -> parsed module."""
    code = sample.prompt.split("```python\n", 1)[1].split("\n```", 1)[0]
    out = {}
    for chunk in re.split(r"^(?=# file: )", code, flags=re.M)[1:]:
        path = chunk.split("\n", 1)[0].removeprefix("# file: ")
        assert path not in out
        out[path] = ast.parse(chunk)
    return out


def _defs(files, kind=ast.FunctionDef):
    return [(path, node) for path, tree in files.items() for node in ast.walk(tree) if isinstance(node, kind)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("task", T.CODE_TASKS)
def test_code_answers_are_unique_and_true_to_the_parsed_code(real_tok, task, seed):
    """Every file parses; the asked name is defined once; the answer is what the code says
    and appears in it as claimed; the question is the prompt's last words."""
    for index, depth in enumerate((0, 50, 100)):
        s = T.make_sample(task, real_tok, 1500, depth, seed=seed, index=index)
        files = _files(s)
        assert len(files) >= 2 and len(s.expected) == 1
        answer, name = s.expected[0], s.key
        assert f"`{name}`" in s.prompt.rsplit("```", 1)[1]            # asked after the code
        funcs = [(p, f) for p, f in _defs(files) if f.name != "__init__"]
        names = [f.name for _, f in funcs]
        assert len(names) == len(set(names)), "every function and method has its own name"
        if task == "code_def":
            assert [p for p, f in funcs if f.name == name] == [answer] and s.answer_kind == "path"
            assert s.prompt.count(f"# file: {answer}\n") == 1
        elif task == "code_value":
            literal = int(answer) if s.answer_kind == "number" else answer
            consts = [(t.id, n.value) for _, n in _defs(files, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
            if name.isupper():                                       # a constant
                assert [ast.literal_eval(v) for c, v in consts if c == name] == [literal]
            else:                                                    # a function returning a literal
                [(_, f)] = [(p, f) for p, f in funcs if f.name == name]
                returns = [n for n in ast.walk(f) if isinstance(n, ast.Return)]
                assert [ast.literal_eval(r.value) for r in returns] == [literal]
            shown = answer if s.answer_kind == "number" else f'"{answer}"'
            assert len(re.findall(rf"(?<![\w.-]){re.escape(shown)}(?![\w.-])", s.prompt)) == 1
            if s.answer_kind == "string":                            # every other string of the code
                strings = {n.value for tree in files.values() for n in ast.walk(tree)
                           if isinstance(n, ast.Constant) and isinstance(n.value, str)}
                assert answer not in s.distractors and set(s.distractors) <= strings
                assert T.score(s, f"{answer}, or maybe {s.distractors[0]}") == 0.0 < T.score(s, answer)
        else:                                                        # code_caller
            calls = [(p, f.name) for p, f in funcs for n in ast.walk(f)
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]
            assert [c for _, c in calls] == [answer] and s.answer_kind == "identifier"
            assert names.count(name) == 1 and answer in names
            assert name not in s.distractors and answer not in s.distractors
            assert set(names) - {name, answer} <= set(s.distractors)


@pytest.mark.parametrize("task", T.CODE_TASKS)
def test_code_prompt_is_chat_and_seeded(real_tok, task):
    a = T.make_sample(task, real_tok, 1200, 30, seed=7, index=2)
    b = T.make_sample(task, real_tok, 1200, 30, seed=7, index=2)
    assert (a.prompt, a.ids, a.expected, a.key, a.distractors) == (b.prompt, b.ids, b.expected, b.key, b.distractors)
    assert a.prompt != T.make_sample(task, real_tok, 1200, 30, seed=8, index=2).prompt
    assert a.prompt.startswith("<|im_start|>system\n") and a.prompt.endswith("<|im_start|>assistant\n")
    code = a.prompt.split("```python\n", 1)[1].split("\n```", 1)[0]
    blocks = code.split("\n\n\n")
    assert len(set(blocks)) == len(blocks) > 10                     # a varied haystack, not one block repeated


@pytest.mark.parametrize("target", [700, 2048, 8192])
def test_code_prompt_length_close_to_target(real_tok, target):
    from engine.eval.code_tasks import LENGTH_SLACK
    for task in T.CODE_TASKS:
        for index in range(2):
            s = T.make_sample(task, real_tok, target, 50, seed=0, index=index)
            assert s.ids == real_tok.encode(s.prompt)
            assert target - LENGTH_SLACK <= s.n_tokens <= target, (task, index, s.n_tokens)


def test_code_needs_room_and_a_chat_template(real_tok):
    with pytest.raises(EngineError, match="cannot hold a code question"):
        T.make_sample("code_caller", real_tok, 120, 50, seed=0, index=0)

    class Plain(WordTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise EngineError("this model has no chat template (tokenizer.chat_template is missing)")
    with pytest.raises(EngineError, match="chat format.*no chat template"):
        T.make_sample("code_def", Plain(), 1000, 50, seed=0, index=0)


@pytest.mark.parametrize("kind, expected, right, wrong", [
    ("path", "pkg/core/ledger.py",
     ["pkg/core/ledger.py", "`pkg/core/ledger.py`", "'./pkg/core/ledger.py'", "It is defined in pkg/core/ledger.py.",
      "The function `load_x` is defined in `Pkg/core/ledger.py`.", "```\npkg/core/ledger.py\n```"],
     ["ledger.py", "pkg/core/ledgers.py", "src/pkg/core/ledger.py", "pkg/core/ledger.py or pkg/io/page.py",
      "pkg/core/ledger", ""]),
    ("number", "4096",
     ["4096", "`4096`", " 4096.", "The value is 4,096.", "MAX_BATCH_SIZE = 4_096", "It returns 4096 (an int)."],
     ["409", "40960", "4096 or 8192", "0x1000", "'4096px'", "version 4096.5"]),
    ("string", "stale-ledger",
     ['"stale-ledger"', "'stale-ledger'", "`stale-ledger`", "stale-ledger", "It returns the string \"stale-ledger\"."],
     ["stale-ledgers", "Stale-Ledger", "stale_ledger", "not-stale-ledger", "stale ledger",
      "stale-ledger or fresh-page", "`fresh-page` (or `stale-ledger`)", "stale-ledger.v2"]),
    ("identifier", "sync_quota",
     ["sync_quota", "`sync_quota`", "sync_quota()", "The function `sync_quota` calls `sync_user`.",
      "pkg.core.sync_quota"],
     ["sync_quotas", "sync_user", "sync_quota or load_page", "`LedgerStore.sync_quota` and `load_page`", "quota"]),
])
def test_code_answers_scored_by_exact_match(kind, expected, right, wrong):
    s = T.Sample("code_x", 100, 0, 0.0, 0, "", [], expected=[expected], answer_kind=kind,
                 distractors=["sync_user_x", "load_page", "LedgerStore"])
    s.task = T.CODE_TASKS[0]
    s.distractors = ["load_page", "LedgerStore", "fresh-page"]      # the prompt's other names and strings
    for text in right:
        assert T.score(s, text) == 1.0, text
    for text in wrong:
        assert T.score(s, text) == 0.0, text


def test_sample_depth_spreads():
    depths = list(range(0, 101, 10))
    assert [T.sample_depth(depths, i, 11) for i in range(11)] == depths
    assert [T.sample_depth(depths, i, 3) for i in range(3)] == [10, 50, 90]
    assert T.sample_depth(depths, 0, 1) == 50
    assert T.sample_depth(depths, 12, 22) == 10


def test_answer_parsing():
    assert T.numbers_in(": 1234567, 89.") == ["1234567", "89"]
    assert T.numbers_in("1,234,567 and 1,2345 or 12,34") == ["1234567", "1", "2345", "12", "34"]
    assert T.numbers_in(":\n1. 1234567\n2. 2345678", min_digits=7) == ["1234567", "2345678"]
    seven = ["1234567"]
    assert not T.answer_complete(" 1234567", seven) and T.answer_complete(" 1234567.", seven)
    # a list marker or a thousands group is not a finished 7-digit answer
    assert not T.answer_complete(":\n\n1.", seven) and not T.answer_complete(" 1,", seven)
    assert not T.answer_complete(" 1,234,567,", seven) and T.answer_complete(" 1,234,567.", seven)
    four = ["1111111", "2222222", "3333333", "4444444"]
    assert not T.answer_complete(":\n1. 1111111\n2. 2222222\n3.", four)
    assert T.answer_complete(":\n1. 1111111\n2. 2222222\n3. 3333333\n4. 4444444\n", four)
    s = T.Sample("niah_multivalue", 100, 0, 0.0, 0, "", [], expected=["1111111", "2222222"])
    assert T.score(s, "1111111, 2222222") == 1.0
    assert T.score(s, "11111112 2222222") == 0.5
    assert T.score(s, "1. 1,111,111\n2. 2222222") == 1.0


def test_greedy_answer_stops_after_the_answer_not_a_list_marker():
    """The decode loop stops once the expected count of answer-length numbers is
    finished: a numbered list or a thousands comma does not end it early."""
    from engine.eval.runner import greedy_numbers
    pieces = [":", "\n", "1", ".", " ", "1", ",", "234", ",", "567", "\n", "2", ".", " 7654321", ".", " more"]
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    inv = {i: p for p, i in vocab.items()}
    it = iter(pieces[1:])

    def step(_token):
        out = np.full(len(vocab), -1.0, dtype=np.float32)
        out[vocab[next(it)]] = 1.0
        return out

    first = np.full(len(vocab), -1.0, dtype=np.float32)
    first[vocab[pieces[0]]] = 1.0
    text, n = greedy_numbers(first, step, lambda ids: "".join(inv[i] for i in ids), set(), 64,
                             ["1234567", "7654321"])
    assert text == ":\n1. 1,234,567\n2. 7654321." and n == 15


def test_policy_names():
    p = parse_policy("snapkv-b1024-head-avg-k5-w64-s4")
    assert (p.budget, p.granularity, p.pool, p.kernel, p.window, p.sinks) == (1024, "head", "avg", 5, 64, 4)
    assert p.config(4000).budget == 1024 and not p.compacts(1024) and p.compacts(1025)
    f = parse_policy("snapkv-bL/8-global-max-k7-w32-s0")
    assert f.config(8000).budget == 1000 and f.name == "snapkv-bL/8-global-max-k7-w32-s0"
    assert parse_policy("full").is_full and parse_policy("full").config(100) is None
    m = parse_policy("snapkv-b2048-head-avg-k31-w32-s4-m64+tq4")
    assert m.merge == 64 and m.config(16000).merge == 64 and m.kv_dtype == "tq4"
    assert m.name == "snapkv-b2048-head-avg-k31-w32-s4-m64+tq4" and m.describe()["merge"] == 64
    assert parse_policy("snapkv-bL/8-head-avg-k31-w32-s4-m64").config(100).budget == 101   # room for the merge
    pyr = parse_policy("snapkv-b1024-head-avg-k31-w32-s4-m64-pyramid")
    assert pyr.config(9000).allocation == "pyramid" and pyr.merge == 64 and pyr.name.endswith("-m64-pyramid")
    assert pyr.config(9000).pyramid_beta == 20 and parse_policy(pyr.name + "20").name == pyr.name
    ada = parse_policy("snapkv-bL/16-head-avg-k31-w32-s4-pyramid5-adaptive")
    assert (ada.allocation, ada.pyramid_beta, ada.config(9000).pyramid_beta) == ("pyramid-adaptive", 5, 5)
    assert ada.name == "snapkv-bL/16-head-avg-k31-w32-s4-pyramid5-adaptive" and ada.describe()["pyramid_beta"] == 5
    for bad in ("snapkv-b64-head-avg-k5-w64-s4", "snapkv-b512-head-avg-k4-w64-s4", "snapkv-b512-row-avg-k5-w64-s4",
                "lru-512", "snapkv-b100-head-avg-k31-w32-s4-m64", "snapkv-b512-head-avg-k5-w64-s4-m",
                "snapkv-b512-head-avg-k5-w64-s4-pyramid0", "snapkv-b512-head-avg-k5-w64-s4-adaptive5"):
        with pytest.raises(EngineError):
            parse_policy(bad)
    names = [p.name for p in default_policies([256, 512, 1024, 2048])]
    assert names[0] == "full" and len(names) == len(set(names)) == 16
    assert {f"snapkv-b1024-head-avg-k{k}-w32-s4" for k in (1, 5, 7, 15)} <= set(names)
    assert "snapkv-b1024-layer-avg-k31-w32-s4" in names and "snapkv-b1024-head-avg-k31-w32-s0" in names
