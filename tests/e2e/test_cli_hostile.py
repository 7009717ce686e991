"""Issue 14, hostile input: every class from the review gives exit code != 0, one
line on stderr and no traceback (or, where the input is legitimate, a clean run)."""
import os
import pty
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFValueType as T

from test_cli_errors import assert_one_line_error, run_cli
from tiny_gguf import write_tiny_gguf

METADATA_CASES = {
    "layers 0": ({"{arch}.block_count": (0, T.UINT32)}, "block_count is 0"),
    "layers as string": ({"{arch}.block_count": ("2", T.STRING)}, "block_count is a string"),
    "layers 2^32-1": ({"{arch}.block_count": (2**32 - 1, T.UINT32)}, "block_count is 4294967295"),
    "heads 0": ({"{arch}.attention.head_count": (0, T.UINT32)}, "head_count is 0"),
    "kv heads 0": ({"{arch}.attention.head_count_kv": (0, T.UINT32)}, "head_count_kv is 0"),
    "kv heads not dividing": ({"{arch}.attention.head_count_kv": (3, T.UINT32)}, "cannot be grouped"),
    "context 2^32-1": ({"{arch}.context_length": (2**32 - 1, T.UINT32)}, "context_length is 4294967295"),
    "rope base NaN": ({"{arch}.rope.freq_base": (float("nan"), T.FLOAT32)}, "freq_base is nan"),
    "rope base negative": ({"{arch}.rope.freq_base": (-1e4, T.FLOAT32)}, "freq_base is -10000"),
    "norm eps NaN": ({"{arch}.attention.layer_norm_rms_epsilon": (float("nan"), T.FLOAT32)}, "epsilon is nan"),
    "alignment 3": ({"general.alignment": (3, T.UINT32)}, "general.alignment"),
}


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_corrupt_metadata(tmp_path, case):
    meta, needle = METADATA_CASES[case]
    p = write_tiny_gguf(tmp_path / "m.gguf", metadata=meta)
    assert_one_line_error(run_cli("run", str(p), "-p", "hi", "-n", "2"), needle)
    assert_one_line_error(run_cli("info", str(p)), needle)


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of the type id in `name`'s tensor info."""
    key = name.encode()
    i = data.find(struct.pack("<Q", len(key)) + key)
    p = i + 8 + len(key)
    n_dims = struct.unpack_from("<I", data, p)[0]
    return p + 4 + 8 * n_dims


def test_corrupt_tensors(tmp_path):
    short = np.zeros((200, 64), np.float32).view(np.uint8)
    p = write_tiny_gguf(tmp_path / "short.gguf", tensor_overrides={"token_embd.weight": (short, Q.F32)})
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "tokenizer has 260 tokens", "200 rows")
    data = bytearray(open(write_tiny_gguf(tmp_path / "q.gguf", qtype=Q.Q4_1), "rb").read())
    at = _tensor_info_offset(data, "blk.0.attn_q.weight")
    misaligned = bytearray(data)
    struct.pack_into("<Q", misaligned, at + 4, struct.unpack_from("<Q", data, at + 4)[0] + 1)
    (tmp_path / "mis.gguf").write_bytes(misaligned)
    assert_one_line_error(run_cli("run", str(tmp_path / "mis.gguf"), "-p", "hi"), "not a multiple of the file's alignment")
    relabelled = bytearray(data)
    struct.pack_into("<I", relabelled, at, int(Q.F32))
    (tmp_path / "f32.gguf").write_bytes(relabelled)
    assert_one_line_error(run_cli("run", str(tmp_path / "f32.gguf"), "-p", "hi"), "overlap")
    nan = np.full((64, 64), np.nan, np.float32).view(np.uint8)
    p = write_tiny_gguf(tmp_path / "nan.gguf", tensor_overrides={"blk.0.attn_q.weight": (nan, Q.F32)})
    assert_one_line_error(run_cli("run", str(p), "-p", "hi"), "non-finite logits")


def test_header_errors_speak_plainly(tmp_path, tiny_llama):
    p = tmp_path / "cut.gguf"
    p.write_bytes(open(tiny_llama, "rb").read()[:20])
    r = run_cli("info", str(p))
    assert_one_line_error(r, "truncated or malformed", "past the end of the file")
    assert "unpack_from" not in r.stderr and "buffer" not in r.stderr


def test_prompt_encodings(tmp_path, tiny_llama):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    assert_one_line_error(run_cli("run", str(tiny_llama), "-f", str(bad)), "not UTF-8", "0xe9")
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(tiny_llama), "-p", b"caf\xe9"],
                       capture_output=True, text=True, timeout=300)
    assert_one_line_error(r, "not valid UTF-8", "0xe9")
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello")
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"hello")
    a = run_cli("run", str(tiny_llama), "-f", str(bom), "-n", "4")
    b = run_cli("run", str(tiny_llama), "-f", str(plain), "-n", "4")
    assert a.returncode == 0 and a.stdout == b.stdout, a.stderr   # the BOM is not part of the prompt


def test_sizes(tiny_llama, smollm2_path):
    r = run_cli("run", str(smollm2_path), "--ctx", "10000000", "-p", "hi", "-n", "1")
    assert_one_line_error(r, "context of 10000000 tokens needs", "GiB", "lower --ctx")
    r = run_cli("run", str(tiny_llama), "--ctx", "1024", "-p", "hi", "-n", "2")
    assert r.returncode == 0 and "above the model's trained context of 512" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_out_paths(tmp_path, tiny_llama):
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert_one_line_error(run_cli("eval", str(tiny_llama), "--quick", "--out", str(f)), "--out", "not a folder")
    assert_one_line_error(run_cli("eval", str(tiny_llama), "--quick", "--out", str(f / "sub")), "--out")
    assert_one_line_error(run_cli("bench", str(tiny_llama), "--out", str(f)), "--out", "not a folder")


@pytest.mark.parametrize("flags,needles", [
    (["--kv-budget", "1"], ["--kv-budget", "--kv-window + --kv-sinks"]),
    (["--kv-kernel", "4"], ["--kv-kernel", "odd"]),
    (["--kv-kernel", "100001"], ["--kv-kernel", "1..1001"]),
    (["-n", "abc"], ["-n/--max-tokens", "invalid int"]),
    (["--temp", "hot"], ["--temp"]),
    (["--no-such-flag"], ["unrecognized arguments"]),
    (["--system", "Be brief."], ["--system needs --chat"]),
])
def test_flag_messages(tiny_llama, tmp_path, flags, needles):
    assert_one_line_error(run_cli("run", str(tiny_llama), "-p", "hi", *flags), *needles)


def test_no_subcommand_is_one_line():
    assert_one_line_error(run_cli(), "required")


def test_stats_line(tiny_llama):
    r = run_cli("run", str(tiny_llama), "-p", "ab " * 100, "-n", "2", "--kv-budget", "64",
                "--kv-min-tokens", "0", "--stats")
    assert r.returncode == 0, r.stderr
    assert "SnapKV budget 64" in r.stderr and "SnapKV SnapKV" not in r.stderr


def test_progress_bar_on_a_terminal(tiny_llama):
    """A long prompt shows a prefill progress bar when stderr is a terminal, not otherwise."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", str(tiny_llama), "-p", "ab " * 500,
                          "-n", "1", "--ctx", "2048", "--prefill-chunk", "128"],
                         stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    p.wait(timeout=300)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0, err
    assert "prefill [" in err and "tokens" in err
    quiet = run_cli("run", str(tiny_llama), "-p", "ab " * 500, "-n", "1", "--ctx", "2048")
    assert "prefill [" not in quiet.stderr
