"""Tokenizer tests: llama.cpp's ids for SmolLM2, plus small hand-built vocabularies."""

import json
import pathlib

import pytest

from engine.errors import EngineError, ModelFileError, UnsupportedError
from engine.model_path import smollm2_model_path
from engine.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, PRE_TOKENIZERS, Tokenizer

FIXTURE = pathlib.Path(__file__).parent.parent / "fixtures" / "smollm2_tokenizer_llamacpp.json"
CASES = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    path = smollm2_model_path()
    if path is None:
        pytest.skip("smollm2 not installed (make setup)")
    from engine.gguf import GgufFile
    return Tokenizer.from_metadata(GgufFile(path).metadata)


def test_code_models_stop_at_the_next_file_as_llama_cpp(smollm):
    """A code model's fill-in-the-middle padding, repository and file separators end
    generation (llama.cpp's end-of-generation set): a completion stops at the next file."""
    names = {smollm.pieces[i] for i in smollm.eot_ids}
    assert names == {"<|endoftext|>", "<|im_end|>", "<reponame>", "<file_sep>"}
    from engine.model_path import named_model_path
    path = named_model_path("qwen2.5-coder-0.5b")
    if path is not None:
        from engine.gguf import GgufFile
        qwen = Tokenizer.from_metadata(GgufFile(path).metadata)
        assert {qwen.pieces[i] for i in qwen.eot_ids} == {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>",
                                                          "<|repo_name|>", "<|file_sep|>"}


# ---- SmolLM2 (gpt2 / smollm) against llama.cpp --------------------------------

@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"])[:40] for c in CASES])
def test_matches_llamacpp_ids_and_round_trips(smollm, case):
    ids = smollm.encode(case["text"], add_bos=False, special=True)
    assert ids == case["ids"]
    assert smollm.decode(ids) == case["text"]


def test_smollm2_properties(smollm):
    assert smollm.vocab_size == 49152
    assert (smollm.bos_id, smollm.eos_id) == (1, 2)
    assert {0, 2} <= smollm.eot_ids  # <|endoftext|>, <|im_end|>
    assert smollm.add_bos is False
    assert smollm.encode("hello world") == [28120, 905]
    assert smollm.encode("hello world", add_bos=True) == [1, 28120, 905]


def test_special_false_treats_control_tokens_as_text(smollm):
    text = "<|im_start|>user"
    assert smollm.encode(text, special=True)[0] == 1
    plain = smollm.encode(text, special=False)
    assert 1 not in plain and len(plain) > 2
    assert smollm.decode(plain) == text


def test_decode_skip_special(smollm):
    ids = smollm.encode("<|im_start|>system\nHi<|im_end|>\n")
    assert smollm.decode(ids, skip_special=True) == "system\nHi\n"


def test_stream_decoder_holds_back_split_emoji(smollm):
    text = "Emoji: 😀👍🏽🇫🇷 🙂"
    ids = smollm.encode(text, add_bos=False)
    stream = smollm.stream()
    chunks = [stream.push(i) for i in ids]
    assert "".join(chunks) + stream.flush() == text
    assert "\ufffd" not in "".join(chunks)
    assert "" in chunks  # some token ended mid-character and was held back
    assert len(smollm.token_bytes(ids[-2])) < 4  # 🙂 is split across two tokens (see fixture)


def test_stream_decoder_flush_replaces_incomplete_tail(smollm):
    first = smollm.encode("🙂", add_bos=False)[0]
    stream = smollm.stream()
    assert stream.push(first) == ""
    assert stream.flush() == "\ufffd"


def test_chat_template_renders_chatml(smollm):
    prompt = smollm.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = smollm.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")


def test_out_of_range_id_is_a_clear_error(smollm):
    with pytest.raises(EngineError, match="outside the vocabulary"):
        smollm.decode([smollm.vocab_size])


# ---- hand-built gpt2 vocabularies: the pre-tokenizer is chosen by tokenizer.ggml.pre ---------

def _byte_level_meta(pre: str | None) -> dict:
    from engine.tokenizer import _byte_to_char
    alphabet = list(_byte_to_char().values())
    merges = ["1 2", "12 3", "123 4", "1234 5", "4 5"]
    tokens = ["<|endoftext|>", *alphabet, "12", "123", "45", "1234", "12345"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL] + [NORMAL] * (len(tokens) - 1),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["12345"]),
    ("smollm", ["1", "2", "3", "4", "5"]),
    ("starcoder", ["1", "2", "3", "4", "5"]),
    ("llama-bpe", ["123", "45"]),
    ("qwen2", ["1", "2", "3", "4", "5"]),
    ("default", ["123", "45"]),
    (None, ["123", "45"]),  # missing pre: llama.cpp falls back to 'default'
])
def test_pre_tokenizer_digit_grouping(pre, pieces):
    tok = Tokenizer.from_metadata(_byte_level_meta(pre))
    ids = tok.encode("12345", add_bos=False)
    assert [tok.pieces[i] for i in ids] == pieces


def test_llama3_pre_adds_bos_by_default():
    tok = Tokenizer.from_metadata(_byte_level_meta("llama-bpe"))
    assert tok.add_bos and tok.encode("1")[0] == 0
    assert not Tokenizer.from_metadata(_byte_level_meta("gpt-2")).add_bos


def test_unsupported_pre_lists_supported_ones():
    with pytest.raises(UnsupportedError, match="'no-such-pre'.*smollm") as err:
        Tokenizer.from_metadata(_byte_level_meta("no-such-pre"))
    assert "\n" not in str(err.value)
    assert {"smollm", "gpt-2", "llama-bpe", "qwen2", "starcoder"} <= PRE_TOKENIZERS.keys()


def test_bad_metadata_errors():
    with pytest.raises(UnsupportedError, match="tokenizer model 'bert'"):
        Tokenizer.from_metadata({**_byte_level_meta("gpt-2"), "tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})


def test_missing_chat_template_is_an_engine_error():
    tok = Tokenizer.from_metadata(_byte_level_meta("gpt-2"))
    with pytest.raises(EngineError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_becomes_engine_error():
    meta = {**_byte_level_meta("gpt-2"),
            "tokenizer.chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"}
    tok = Tokenizer.from_metadata(meta)
    with pytest.raises(EngineError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_a_template_bug_is_an_engine_error_and_tojson_takes_hf_arguments():
    meta = {**_byte_level_meta("gpt-2"), "tokenizer.chat_template": "{{ 'a' + 1 }}"}
    with pytest.raises(EngineError, match="chat template failed: TypeError"):
        Tokenizer.from_metadata(meta).apply_chat_template([{"role": "user", "content": "hi"}])
    meta["tokenizer.chat_template"] = "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=True) }}"
    out = Tokenizer.from_metadata(meta).apply_chat_template([{"role": "user", "content": "hi"}],
                                                            add_generation_prompt=False)
    assert out == '{"content":"hi","role":"user"}'
    meta["tokenizer.chat_template"] = "{{ messages[0] | tojson(ensure_ascii=False) }} {{ 'é' | tojson(true) }}"
    out = Tokenizer.from_metadata(meta).apply_chat_template([{"role": "user", "content": "é"}],
                                                            add_generation_prompt=False)
    assert out == '{"role": "user", "content": "é"} "\\u00e9"'     # (GLM-4's, MiniCPM's tool templates)


@pytest.mark.parametrize("template, kind", [
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed: RecursionError"),
    ("{{ 'abc' | truncate(-5) }}", "failed: AssertionError"),
    ("{{ 'x' * 2 ** 40 }}", "failed: .*past the template limit"),
    ("{{ 2 ** (2 ** 40) }}", "failed: .*past the template limit"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "does not compile: RecursionError"),
    ("{% if 1 %}" * 200 + "{% endif %}" * 200, "does not compile"),
])
def test_any_template_failure_is_one_engine_error_line(template, kind):
    """Whatever a (hostile or broken) template raises, at compile or render: one line, not a
    traceback; values past the sandbox's bound are refused before they are made."""
    meta = {**_byte_level_meta("gpt-2"), "tokenizer.chat_template": template}
    with pytest.raises(EngineError, match=f"chat template {kind}") as e:
        Tokenizer.from_metadata(meta).apply_chat_template([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


# ---- hand-built SentencePiece ('llama') vocabulary -------------------------------------------

def _spm_meta() -> dict:
    # (piece, score, type): specials, 256 byte tokens, then pieces; higher score merges first
    entries = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    entries += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "llo", "hello", "▁hello",
              "or", "▁w", "▁wor", "ld", "▁world", "▁h"]
    entries += [(p, -float(i), NORMAL) for i, p in enumerate(pieces)]
    entries += [("<tool>", 0.0, USER_DEFINED)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [e[0] for e in entries],
        "tokenizer.ggml.scores": [e[1] for e in entries],
        "tokenizer.ggml.token_type": [e[2] for e in entries],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(_spm_meta())


def test_spm_encode_decode(spm):
    ids = spm.encode("hello world")
    assert [spm.pieces[i] for i in ids] == ["<s>", "▁hello", "▁world"]  # add_bos defaults on for SPM
    assert spm.decode(ids) == "<s>hello world"
    assert spm.decode(ids, skip_special=True) == "hello world"
    assert spm.decode(spm.encode("hello  world", add_bos=False)) == "hello  world"


def test_a_continuation_keeps_its_leading_space_and_skips_control_tokens(spm):
    """A generated answer continues the prompt's text: its first piece keeps the space
    SPM strips only at a text's start ("The capital is" -> " Paris", as llama.cpp and
    vLLM), and control tokens (an end of turn with ignore_eos) decode to nothing."""
    ids = spm.encode("hello world", add_bos=False)
    start, cont = spm.stream(), spm.stream(skip_special=True, continuation=True)
    assert [start.push(i) for i in ids] == ["hello", " world"]
    assert [cont.push(i) for i in ids + [spm.eos_id]] == [" hello", " world", ""]


def test_a_chat_prompt_gets_no_second_bos(spm):
    bos = spm.pieces[spm.bos_id]
    assert spm.chat_add_bos(bos + "<start_of_turn>user") is False   # the template wrote it
    assert spm.chat_add_bos("user: hi") is None                      # the model's default
    assert spm.encode(bos + "hi", add_bos=spm.chat_add_bos(bos + "hi"))[:2] == [spm.bos_id, spm.encode("hi", add_bos=False)[0]]


def test_spm_byte_fallback(spm):
    ids = spm.encode("hé€", add_bos=False)
    assert [spm.pieces[i] for i in ids] == ["▁h", "<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>"]
    assert spm.decode(ids) == "hé€"
    stream = spm.stream()
    assert [stream.push(i) for i in ids] == ["h", "", "é", "", "", "€"]


def test_spm_special_tokens_and_space_prefix(spm):
    # llama.cpp prefixes a space to the text and to every fragment after a special token
    ids = spm.encode("hello</s>world", add_bos=False)
    assert [spm.pieces[i] for i in ids] == ["▁hello", "</s>", "▁world"]
    plain = spm.encode("</s>", add_bos=False, special=False)
    assert spm.eos_id not in plain
    # user-defined tokens split even with special=False, as in llama.cpp
    assert spm.encode("<tool>", add_bos=False, special=False) == [spm.pieces.index("<tool>")]
    assert spm.eot_ids == {2}


# ---- the second model (Gemma 3 270M, SentencePiece `llama`, 262144 pieces) against llama.cpp --------

GEMMA3_FIXTURE = pathlib.Path(__file__).parent.parent / "fixtures" / "gemma3_tokenizer_llamacpp.json"
GEMMA3_CASES = json.loads(GEMMA3_FIXTURE.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def gemma3() -> Tokenizer:
    from engine.model_path import gemma3_model_path
    path = gemma3_model_path()
    if path is None:
        pytest.skip("Gemma 3 270M not installed (make setup)")
    from engine.gguf import GgufFile
    return Tokenizer.from_metadata(GgufFile(path).metadata)


@pytest.mark.parametrize("case", GEMMA3_CASES, ids=[repr(c["text"])[:40] for c in GEMMA3_CASES])
def test_gemma3_matches_llamacpp_ids_and_round_trips(gemma3, case):
    ids = gemma3.encode(case["text"], add_bos=False, special=True)
    assert ids == case["ids"]
    assert gemma3.decode(ids) == case["text"]


def test_gemma3_properties(gemma3):
    assert gemma3.vocab_size == 262144
    assert (gemma3.bos_id, gemma3.eos_id) == (2, 1)
    assert gemma3.add_bos is True
    assert gemma3.encode("Hello world") == [2, 9259, 1902]


class _ScanningFinder:
    """llama.cpp's partition as written: every piece tested against the text with `in`."""

    def __init__(self, pieces):
        self.pieces = [p for p in pieces if p]

    def present(self, text):
        return {p for p in self.pieces if p in text}


def _partition_by_scanning(tok, text, special):
    scanning = Tokenizer.__new__(Tokenizer)
    scanning._specials, scanning._user_defined = tok._specials, tok._user_defined
    scanning._finders = {key: _ScanningFinder(f.pieces) for key, f in tok._finders.items()}
    return scanning._partition(text, special)


def test_special_pieces_are_found_in_one_pass_as_scanning_each_finds_them():
    """PieceFinder (one regex over the text) finds exactly the pieces `in` finds, overlapping
    ones and pieces that are prefixes of others included, so the partition is unchanged."""
    import random
    from engine.tokenizer import PieceFinder
    pieces = ["ab", "abc", "bcd", "c", "<a>", "a>", "<", "\n\n", "\n", "[x]", "x]", ".*", "\\"]
    finder = PieceFinder(pieces + [""])
    specials = sorted(enumerate(pieces), key=lambda t: -len(t[1]))
    rnd = random.Random(0)
    tok = Tokenizer.__new__(Tokenizer)
    tok._specials = tok._user_defined = specials
    tok._finders = {"special": PieceFinder(pieces), "user": PieceFinder(pieces)}
    for _ in range(5000):
        text = "".join(rnd.choice("abcd<>\n[x].*\\") for _ in range(rnd.randrange(0, 14)))
        assert finder.present(text) == _ScanningFinder(pieces).present(text), repr(text)
        assert tok._partition(text, True) == _partition_by_scanning(tok, text, True), repr(text)
    assert PieceFinder([]).present("abc") == set()


def test_gemma3_partition_is_the_scanning_one(gemma3):
    text = (pathlib.Path(__file__).read_text() * 3 + "<start_of_turn>user\n\t\t  <unused12><end_of_turn>"
            "\n\n\n\n\n<start_of_image>" + " " * 40)
    assert gemma3._partition(text, True) == _partition_by_scanning(gemma3, text, True)
    assert gemma3._partition(text, False) == _partition_by_scanning(gemma3, text, False)
    assert gemma3.control_text_in("a <end_of_turn> b") and not gemma3.control_text_in("a \n\n\t b")
