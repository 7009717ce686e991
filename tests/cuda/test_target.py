"""What NVRTC builds for a live GPU (nvrtc.choose_target), without a GPU: SASS for the
device's own arch when the loaded NVRTC has it, else PTX for the newest arch below it
(the driver compiles PTX forward; a cubin for another arch does not load), and
BackendUnavailable in one line below sm_75 or with no usable arch. Also the offline
command's `--arch` for archs beyond ARCHS."""
import pytest

from backends.cuda import nvrtc
from backends.cuda.nvrtc import Target, choose_target
from engine.errors import BackendUnavailable

# getSupportedArchs() of real NVRTC releases (12.4 and 12.9: this machine's; 13.0 per its notes)
NVRTC_12_4 = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90)
NVRTC_12_9 = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121)
NVRTC_13_0 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)
RELEASES = {"12.4": NVRTC_12_4, "12.9": NVRTC_12_9, "13.0": NVRTC_13_0}


@pytest.mark.parametrize("device_cc, supported, expected", [
    (90, NVRTC_12_4, Target(90, "cubin")),        # Hopper, NVRTC before Blackwell
    (75, NVRTC_12_4, Target(75, "cubin")),
    (86, NVRTC_12_9, Target(86, "cubin")),
    (100, NVRTC_12_4, Target(90, "ptx")),         # B200 with NVRTC < 12.8: PTX, not sm_90 SASS
    (120, NVRTC_12_4, Target(90, "ptx")),         # RTX 50xx likewise
    (120, NVRTC_12_9, Target(120, "cubin")),
    (100, NVRTC_12_9, Target(100, "cubin")),
    (103, NVRTC_13_0, Target(103, "cubin")),
    (87, NVRTC_12_9, Target(87, "cubin")),        # Jetson Orin: its own SASS
    (87, (75, 80, 86, 89, 90), Target(86, "ptx")),
    (110, NVRTC_12_9, Target(103, "ptx")),        # Thor is sm_110 under CUDA 13 (12.9 calls it 101)
    (110, NVRTC_13_0, Target(110, "cubin")),
    (130, NVRTC_13_0, Target(121, "ptx")),        # a GPU newer than the NVRTC
    (89, (75, 80, 86), Target(86, "ptx")),
])
def test_choose_target(device_cc, supported, expected):
    assert choose_target(device_cc, supported) == expected


@pytest.mark.parametrize("device_cc", [70, 72, 61, 53])
def test_below_sm_75_is_unavailable(device_cc):
    with pytest.raises(BackendUnavailable, match=r"compute capability \d\.\d is below 7\.5") as info:
        choose_target(device_cc, NVRTC_12_9)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("supported", [(), (50, 60, 70, 72), (80, 86, 90)], ids=["none", "old", "above"])
def test_no_usable_arch_is_unavailable(supported):
    with pytest.raises(BackendUnavailable, match="install a newer one") as info:
        choose_target(75, supported)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("release", RELEASES)
def test_choice_rule_for_every_arch(release):
    """Every compute capability from 7.5 to 13.1: the device's own SASS when the release
    builds it, otherwise PTX of the newest arch from 7.5 below the device (JIT-compiled
    forward by the driver), never SASS of another arch."""
    supported = RELEASES[release]
    for cc in range(75, 132):
        t = choose_target(cc, supported)
        if cc in supported:
            assert t == Target(cc, "cubin"), cc
        else:
            assert t.kind == "ptx" and t.arch in supported and 75 <= t.arch < cc, (cc, t)
            assert not [a for a in supported if t.arch < a < cc], (cc, t)
        assert t.option == (f"-arch=sm_{cc}" if t.kind == "cubin" else f"-arch=compute_{t.arch}")


def test_runtime_flags_in_options():
    opts = nvrtc.options(("KV_K=KV_Q8_0",), Target(90, "cubin"))
    assert opts[0] == "-arch=sm_90" and "-ftz=true" in opts and "-std=c++17" in opts
    assert opts[-1] == "-DKV_K=KV_Q8_0"
    assert nvrtc.options((), Target(90, "ptx"))[0] == "-arch=compute_90"


# -- with the loaded NVRTC ------------------------------------------------------------------


def test_version_table_matches_loaded_nvrtc(nvrtc_loaded):
    """The fallback table (for a binding without getSupportedArchs) agrees with NVRTC."""
    v = nvrtc.version()
    entry = dict(nvrtc._ARCHS_BY_VERSION).get(v)
    if entry is None:
        pytest.skip(f"no table entry for NVRTC {v}")
    assert entry == nvrtc.supported_archs()


def test_ptx_target_compiles(nvrtc_loaded):
    result = nvrtc.compile_source('extern "C" __global__ void k(int* x) { x[0] = 1; }', "k.cu", (),
                                  Target(90, "ptx"))
    assert b".target sm_90" in result.image and b".entry k" in result.image and result.kernels == {}


def test_cli_accepts_any_supported_arch(nvrtc_loaded, capsys):
    arch = max(nvrtc.supported_archs())          # 121 with NVRTC 12.9, beyond ARCHS
    assert nvrtc.main(["--arch", str(arch), "rope.cu"]) == 0
    out = capsys.readouterr().out
    assert f"sm_{arch}:" in out and "-ftz=true" in out and " rope " in out.replace("rope.cu", "")


def test_cli_rejects_unsupported_arch_naming_the_runtime_choice(nvrtc_loaded, monkeypatch, capsys):
    monkeypatch.setattr(nvrtc, "supported_archs", lambda: NVRTC_12_4)
    assert nvrtc.main(["--arch", "100", "rope.cu"]) == 2
    err = capsys.readouterr().err
    assert "builds no SASS for sm_100" in err and "a sm_100 GPU loads compute_90 PTX" in err
    assert err.count("\n") == 1
